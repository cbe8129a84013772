"""The parts of the public API (generation.proto) that the SDK builds and the gateway reads, or the
other way round, as to/from pairs: a chat's turns, a request's token counts (Usage) and the
served model's facts (ModelInfo). What only one side does stays there: the SDK's arguments and
replies (``pagedserve.wire``), the gateway's validated input and streamed chunks
(``gateway_service.convert``). The SDK imports this module: it needs protobuf only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from servicekit.contract.api import ModelInfo, Usage
from servicekit.contract.chat import WIRE_ROLES, check_chat_message
from servicekit.contract.errors import InvalidArgumentError
from servicekit.proto.pb import generation_pb2

# A conversation's turns are bounded before they are copied or rendered (each turn costs template
# tokens, so far more turns than this could not fit any served model's context anyway).
MAX_CHAT_MESSAGES = 1024


def chat_to_pb(messages: Iterable[Mapping], chat: generation_pb2.Chat) -> None:
    """Append ``messages`` (mappings with "role" and "content"; an assistant turn may have OpenAI's
    "tool_calls", a "tool" turn its "tool_call_id") to ``chat``, checking each turn
    (InvalidArgumentError names ``messages[i]``, or its role or content). An empty list is an empty
    chat (refused by the gateway), not no input."""
    chat.SetInParent()
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidArgumentError(f"messages[{i}]", f"must be a mapping with role and content; got {type(m).__name__}")
        content = m.get("content")
        if content is None and m.get("tool_calls"):  # OpenAI's shape of a turn that only called tools
            content = ""
        check_chat_message(i, m.get("role"), content, WIRE_ROLES)
        turn = chat.messages.add(role=m["role"], content=content, tool_call_id=m.get("tool_call_id") or "")
        for k, call in enumerate(m.get("tool_calls") or ()):
            _tool_call_to_pb(f"messages[{i}].tool_calls[{k}]", call, turn.tool_calls.add())


def _tool_call_to_pb(where: str, call, out: generation_pb2.ToolCall) -> None:
    """A call as OpenAI shapes it ({"id", "function": {"name", "arguments"}}) or flat ({"id",
    "name", "arguments"}); arguments as JSON text or an object."""
    function = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidArgumentError(where, "must be a call: a mapping with a function name and arguments")
    arguments = function.get("arguments") or "{}"
    out.id = call.get("id") or ""
    out.name = function["name"]
    out.arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def chat_from_pb(chat: generation_pb2.Chat) -> list[dict]:
    """The turns of a Chat, as OpenAI shapes them (an assistant turn's ``tool_calls``, a tool turn's
    ``tool_call_id`` when set); raises InvalidArgumentError naming the first bad one
    (``messages`` when there are more than ``MAX_CHAT_MESSAGES``, else ``messages[1].role``)."""
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgumentError("messages", f"at most {MAX_CHAT_MESSAGES} chat messages, got {len(chat.messages)}")
    turns = []
    for i, m in enumerate(chat.messages):
        check_chat_message(i, m.role, m.content, WIRE_ROLES)
        turn: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            turn["tool_calls"] = [tool_call_from_pb(call) for call in m.tool_calls]
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        turns.append(turn)
    return turns


def tool_call_from_pb(call: generation_pb2.ToolCall) -> dict:
    """A ToolCall as OpenAI shapes one."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def usage_to_pb(usage: Usage, out: generation_pb2.Usage) -> None:
    """Write ``usage`` into ``out`` (a GenerateResponse's ``usage``, which it sets)."""
    out.prompt_tokens = usage.prompt_tokens
    out.completion_tokens = usage.completion_tokens
    out.cached_prompt_tokens = usage.cached_prompt_tokens


def usage_from_pb(msg: generation_pb2.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_prompt_tokens)


def model_info_to_pb(info: ModelInfo) -> generation_pb2.ModelInfoResponse:
    return generation_pb2.ModelInfoResponse(
        model=info.model, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids), num_workers=info.num_workers, block_size=info.block_size,
        sampling_defaults=dict(info.sampling_defaults))


def model_info_from_pb(msg: generation_pb2.ModelInfoResponse) -> ModelInfo:
    return ModelInfo(model=msg.model, max_model_len=msg.max_model_len, vocab_size=msg.vocab_size,
                     eos_token_ids=tuple(msg.eos_token_ids), num_workers=msg.num_workers, block_size=msg.block_size,
                     sampling_defaults=tuple(sorted(msg.sampling_defaults.items())))
