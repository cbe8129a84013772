"""The gateway's domain objects: what a Generate call asks for and what it streams back (the
scheduler's output records are the ground's: ``servicekit.contract.records``). Protobuf stays in
``convert.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway_service.tool_calls import ToolCall, ToolChoice
from servicekit.contract.api import Usage
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import FinishReason, TokenLogprobs


MAX_USER_CHARS = 256  # an end-user id; it may become a tenant: a label and a key in the fair queue


def checked_user(user: str, field: str = "user") -> str:
    """An end-user id as given, or InvalidArgumentError naming ``field`` when it is too long."""
    if len(user) > MAX_USER_CHARS:
        raise InvalidArgumentError(field, f"at most {MAX_USER_CHARS} characters, got {len(user)}")
    return user


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """One Generate call, validated field by field (sampling params included)."""

    sampling_params: SamplingParams
    prompt: str | None = None  # exactly one of prompt / messages / prompt_token_ids
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    model: str = ""
    request_id: str = ""  # "" = assign one
    resume_from_index: int | None = None
    priority: int = 0
    cache_salt: str = ""
    user: str = ""  # the end user it serves (OpenAI's ``user``): its tenant when the gateway has no API keys
    include_special_tokens: bool = False
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: max_model_len)
    add_special_tokens: bool = True  # prompt text only: the model's special tokens (BOS) added
    include_stop_str: bool = False  # include_stop_str_in_output: a stop string's or stop token's text kept
    # messages only: how the chat template renders them (PromptTokenizer.chat_text)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None  # extra template variables (vLLM's; {"enable_thinking": False})
    # messages only: the tools the answer may call (already described in messages; a required or
    # named choice's constraint already in sampling_params); the chunks' text is then content only
    tools: ToolChoice | None = None


@dataclass(slots=True)
class GenerateChunk:
    """One streamed response: new text and tokens, and on the last one the finish reason + usage."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    first_index: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stop_string: str = ""
    stop_token_id: int | None = None  # the stop_token_ids entry that ended the output (its text not in text)
    num_prompt_tokens: int = 0  # on every chunk (the OpenAI API's per-chunk usage reads it)
    # on the chunk with the first token, when SamplingParams.prompt_logprobs was set: one per prompt
    # token after the first
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # on the chunk with the first token when prompt_logprobs were asked for (gateway-internal)
    prompt_token_ids: list[int] = field(default_factory=list)
    # on the last chunk of an answer with tools that called any (its finish_reason is then STOP)
    tool_calls: list[ToolCall] = field(default_factory=list)
