"""Protobuf <-> dataclass conversions for the messages every service shares (sampling.proto).

Each service's own ``convert.py`` builds on these; nothing else touches ``*_pb2`` (STYLE.md 5).
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedserve.errors import InvalidArgumentError
from pagedserve.pb import sampling_pb2
from scheduler_service.core.outputs import FinishReason, TokenLogprobs
from scheduler_service.core.sampling_params import SamplingParams

_SCALAR_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
)

FINISH_REASON_TO_PB = {
    None: sampling_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: sampling_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: sampling_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: sampling_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_FROM_PB = {v: k for k, v in FINISH_REASON_TO_PB.items()}


def sampling_params_from_pb(msg: sampling_pb2.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; raises InvalidParameterError naming a bad field."""
    kwargs = {name: getattr(msg, name) for name in _SCALAR_FIELDS if msg.HasField(name)}
    return SamplingParams(stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids), **kwargs)


def sampling_params_to_pb(params: SamplingParams, out: sampling_pb2.SamplingParams | None = None
                          ) -> sampling_pb2.SamplingParams:
    msg = out if out is not None else sampling_pb2.SamplingParams()
    for name in _SCALAR_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    msg.stop.extend(params.stop)
    msg.stop_token_ids.extend(params.stop_token_ids)
    return msg


def logprobs_to_pb(items: list[TokenLogprobs], out) -> None:
    """Append ``items`` to the repeated TokenLogprobs field ``out``."""
    for item in items:
        msg = out.add(token_id=item.token_id, logprob=item.logprob)
        for token_id, logprob in item.top:
            msg.top.add(token_id=token_id, logprob=logprob)


def logprobs_from_pb(items) -> list[TokenLogprobs]:
    return [TokenLogprobs(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top]) for m in items]


# -- chat ---------------------------------------------------------------------------------------------

CHAT_ROLES = ("system", "user", "assistant")  # generation.proto ChatMessage.role


def check_chat_message(index: int, role, content) -> None:
    """One chat turn as the gateway takes it: a known role and non-empty text. Raises
    InvalidArgumentError naming the field (``messages[1].role``); the SDK and the gateway both
    check with this, so a turn the SDK builds is one the gateway accepts."""
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise InvalidArgumentError(f"messages[{index}].role", f"must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
    if not isinstance(content, str) or not content:
        raise InvalidArgumentError(f"messages[{index}].content", "required: a non-empty string")


def _add_chat(chat, messages) -> None:
    """Append SDK ``messages`` (mappings with "role" and "content") to a Chat message."""
    chat.SetInParent()  # an empty list is an empty chat (refused by the gateway), not no input
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidArgumentError(f"messages[{i}]", f"must be a mapping with role and content; got {type(m).__name__}")
        check_chat_message(i, m.get("role"), m.get("content"))
        chat.messages.add(role=m["role"], content=m["content"])


# -- client SDK ---------------------------------------------------------------------------------------

_SAMPLING_KWARGS = frozenset(_SCALAR_FIELDS) | {"stop", "stop_token_ids"}


def build_generate_request(prompt=None, *, messages=None, sampling_params: SamplingParams | None = None,
                           request_id: str = "", model: str = "", priority: int = 0, cache_salt: str = "",
                           include_special_tokens: bool = False, resume_from_index: int | None = None,
                           **sampling):
    """A GenerateRequest from SDK arguments. ``prompt``: text or token ids; ``messages``: a chat.
    ``sampling``: SamplingParams fields by name (validated by the gateway, not here)."""
    from pagedserve.pb import generation_pb2

    unknown = set(sampling) - _SAMPLING_KWARGS
    if unknown:
        raise TypeError(f"unknown sampling arguments: {', '.join(sorted(unknown))}")
    msg = generation_pb2.GenerateRequest(request_id=request_id, model=model, priority=priority,
                                         cache_salt=cache_salt, include_special_tokens=include_special_tokens)
    if messages is not None:
        _add_chat(msg.chat, messages)
    elif isinstance(prompt, str):
        msg.prompt = prompt
    elif prompt is not None:
        msg.prompt_token_ids.ids.extend(int(t) for t in prompt)
    if resume_from_index is not None:
        msg.resume_from_index = resume_from_index
    if sampling_params is not None:
        sampling_params_to_pb(sampling_params, msg.sampling_params)
    sp = msg.sampling_params
    for name, value in sampling.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            field = getattr(sp, name)
            del field[:]
            field.extend([value] if isinstance(value, str) else value)
        else:
            setattr(sp, name, value)
    return msg


def chunk_from_pb(msg):
    from pagedserve.client_types import Chunk, Usage

    return Chunk(
        request_id=msg.request_id, text=msg.text, token_ids=tuple(msg.token_ids), first_index=msg.first_index,
        logprobs=tuple(logprobs_from_pb(msg.logprobs)) if msg.logprobs else (),
        finish_reason=None if msg.finish_reason == sampling_pb2.FINISH_REASON_UNSPECIFIED
        else str(FINISH_REASON_FROM_PB[msg.finish_reason]),
        usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_prompt_tokens)
        if msg.HasField("usage") else None,
        stop_string=msg.stop_string)


def build_tokenize_request(text=None, *, messages=None, model: str = ""):
    from pagedserve.pb import generation_pb2

    msg = generation_pb2.TokenizeRequest(model=model)
    if messages is not None:
        _add_chat(msg.chat, messages)
    else:
        msg.text = text or ""
    return msg


def model_info_from_pb(msg):
    from pagedserve.client_types import ModelInfo

    return ModelInfo(model=msg.model, max_model_len=msg.max_model_len, vocab_size=msg.vocab_size,
                     eos_token_ids=tuple(msg.eos_token_ids), num_workers=msg.num_workers, block_size=msg.block_size)
