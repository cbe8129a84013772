"""The client SDK's protobuf layer: requests built from SDK arguments, replies turned into the SDK's
dataclasses (:mod:`pagedserve.client_types`). Only the SDK touches ``*_pb2`` on the client side."""

from __future__ import annotations

import json
from collections.abc import Mapping

from pagedserve.client_types import Chunk, ToolCall
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.prompt import check_text, token_id_list
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.structured_output import structured_output_of
from servicekit.proto.generation import chat_to_pb, usage_from_pb
from servicekit.proto.pb import generation_pb2, sampling_pb2
from servicekit.proto.sampling import FIELDS as SAMPLING_FIELDS
from servicekit.proto.sampling import (
    FINISH_REASON_FROM_PB,
    logprobs_from_pb,
    sampling_params_to_pb,
    structured_output_to_pb,
)


def build_generate_request(prompt=None, *, messages=None, sampling_params: SamplingParams | None = None,
                           request_id: str = "", model: str = "", priority: int = 0, cache_salt: str = "",
                           user: str = "", include_special_tokens: bool = False, resume_from_index: int | None = None,
                           add_generation_prompt: bool | None = None, continue_final_message: bool = False,
                           truncate_prompt_tokens: int | None = None, tools=None, tool_choice=None,
                           parallel_tool_calls: bool | None = None, **sampling):
    """A GenerateRequest from SDK arguments. ``prompt``: text or token ids; ``messages``: a chat
    (``add_generation_prompt``, default true, and ``continue_final_message`` as in vLLM's chat).
    ``tools``: functions the chat's answer may call, as OpenAI's ``tools`` entries or flat
    ``{"name", "description", "parameters"}`` mappings (parameters: a JSON Schema); ``tool_choice``:
    "auto", "none", "required", or a tool's name / OpenAI's ``{"type": "function", "function":
    {"name": ...}}`` for that one tool.
    ``truncate_prompt_tokens``: keep the prompt's last N tokens (-1: the model's length).
    ``user``: the end user the request serves (at most 256 characters), its tenant for fair shares
    when the gateway takes tenants from it (OpenAI's ``user``).
    ``sampling``: SamplingParams fields by name (validated by the gateway, not here)."""
    unknown = set(sampling).difference(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling arguments: {', '.join(sorted(unknown))}")
    msg = generation_pb2.GenerateRequest()
    for name, value in (("request_id", request_id), ("model", model), ("priority", priority),
                        ("cache_salt", cache_salt), ("user", user), ("include_special_tokens", include_special_tokens),
                        ("resume_from_index", resume_from_index), ("truncate_prompt_tokens", truncate_prompt_tokens)):
        if value is not None:
            _set(msg, name, value)
    if messages is not None and prompt is not None:
        raise InvalidArgumentError("messages", "give a prompt or messages (a chat), not both")
    if messages is not None:
        chat_to_pb(messages, msg.chat)
        if add_generation_prompt is not None:
            msg.chat.add_generation_prompt = add_generation_prompt
        msg.chat.continue_final_message = continue_final_message
        _tools_to_pb(tools, tool_choice, parallel_tool_calls, msg.chat)
    elif tools or tool_choice is not None or parallel_tool_calls is not None:
        raise InvalidArgumentError("tools", "only apply to messages (a chat)")
    elif add_generation_prompt is not None or continue_final_message:
        raise InvalidArgumentError("continue_final_message" if continue_final_message else "add_generation_prompt",
                                   "only applies to messages (a chat)")
    elif isinstance(prompt, str):
        check_text("prompt", prompt)
        msg.prompt = prompt
    elif prompt is not None:
        msg.prompt_token_ids.ids.extend(token_id_list(prompt, "prompt_token_ids"))
    if sampling_params is not None:
        sampling_params_to_pb(sampling_params, msg.sampling_params)
    sp = msg.sampling_params
    for name, value in sampling.items():
        if value is None:
            continue
        if name == "structured_output":  # a StructuredOutput or {"json": schema} / {"regex": ...} / ...
            sp.ClearField("structured_output")
            structured_output_to_pb(structured_output_of(value), sp.structured_output)
        elif name == "logit_bias":  # {token_id: bias} or (id, bias) pairs
            sp.logit_bias.clear()
            try:
                sp.logit_bias.update(dict(value))
            except (TypeError, ValueError) as exc:  # an id the wire cannot carry (negative, not an int)
                raise InvalidArgumentError("logit_bias", f"must map token ids (>= 0) to biases: {exc}") from None
        else:  # a list field (stop, stop_token_ids, allowed_token_ids) is replaced; one stop string is a list
            _set(sp, name, [value] if name == "stop" and isinstance(value, str) else value)
    return msg


def _tools_to_pb(tools, tool_choice, parallel_tool_calls: bool | None, chat) -> None:
    for i, tool in enumerate(tools or ()):
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping):
            raise InvalidArgumentError(f"tools[{i}]", "must be a mapping with name, description and parameters")
        parameters = function.get("parameters")
        try:
            text = parameters if isinstance(parameters, str) or parameters is None else json.dumps(parameters)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"tools[{i}].parameters", f"must be a JSON Schema: {exc}") from None
        _set(chat.tools.add(), "name", function.get("name") or "")
        chat.tools[-1].description = function.get("description") or ""
        chat.tools[-1].parameters = text or ""
    if isinstance(tool_choice, Mapping):  # OpenAI's {"type": "function", "function": {"name": ...}}
        tool_choice = (tool_choice.get("function") or {}).get("name") or ""
        chat.tool_choice_function = tool_choice
    elif tool_choice in ("auto", "none", "required", None):
        chat.tool_choice = tool_choice or ""
    elif isinstance(tool_choice, str):
        chat.tool_choice_function = tool_choice
    else:
        raise InvalidArgumentError("tool_choice", 'must be "auto", "none", "required" or a tool\'s name')
    if parallel_tool_calls is not None:
        chat.parallel_tool_calls = parallel_tool_calls


def _set(msg, name: str, value) -> None:
    """``msg.name = value`` (a repeated field: its items replaced), a value the wire cannot carry
    (a string for a number, a float for an integer, out of the field's range) refused naming the
    argument, not as protobuf's bare TypeError / ValueError."""
    field = getattr(msg, name)
    try:
        if isinstance(field, (bool, int, float, str, bytes)):  # a scalar field
            setattr(msg, name, value)
        else:
            del field[:]
            field.extend(value)
    except (TypeError, ValueError) as exc:
        shown = repr(value)
        raise InvalidArgumentError(name, f"{shown if len(shown) <= 80 else shown[:77] + '...'} does not fit "
                                         f"({exc})") from None


def _finish_reason(value: int) -> str | None:
    if value == sampling_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    if value == sampling_pb2.FINISH_REASON_TOOL_CALLS:
        return "tool_calls"
    return str(FINISH_REASON_FROM_PB[value])


def chunk_from_pb(msg):
    return Chunk(
        request_id=msg.request_id, text=msg.text, token_ids=tuple(msg.token_ids), first_index=msg.first_index,
        logprobs=tuple(logprobs_from_pb(msg.logprobs)) if msg.logprobs else (),
        finish_reason=_finish_reason(msg.finish_reason),
        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls),
        usage=usage_from_pb(msg.usage) if msg.HasField("usage") else None,
        stop_string=msg.stop_string, stop_token_id=msg.stop_token_id if msg.HasField("stop_token_id") else None,
        prompt_logprobs=tuple(logprobs_from_pb(msg.prompt_logprobs)) if msg.prompt_logprobs else ())


def build_tokenize_request(text=None, *, messages=None, model: str = ""):
    msg = generation_pb2.TokenizeRequest(model=model)
    if messages is not None and text is not None:
        raise InvalidArgumentError("messages", "give text or messages (a chat), not both")
    if messages is not None:
        chat_to_pb(messages, msg.chat)
    else:
        msg.text = text or ""
    return msg
