"""The parts of the public API (generation.proto) that the SDK builds and the gateway reads, or the
other way round, as to/from pairs: a chat's turns, a request's token counts (Usage) and the
served model's facts (ModelInfo). What only one side does stays there: the SDK's arguments and
replies (``pagedserve.wire``), the gateway's validated input and streamed chunks
(``gateway_service.convert``). The SDK imports this module: it needs protobuf only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from servicekit.contract.api import ModelInfo, Usage
from servicekit.contract.chat import check_chat_message
from servicekit.contract.errors import InvalidArgumentError
from servicekit.proto.pb import generation_pb2

# A conversation's turns are bounded before they are copied or rendered (each turn costs template
# tokens, so far more turns than this could not fit any served model's context anyway).
MAX_CHAT_MESSAGES = 1024


def chat_to_pb(messages: Iterable[Mapping], chat: generation_pb2.Chat) -> None:
    """Append ``messages`` (mappings with "role" and "content") to ``chat``, checking each turn
    (InvalidArgumentError names ``messages[i]``, or its role or content). An empty list is an empty
    chat (refused by the gateway), not no input."""
    chat.SetInParent()
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidArgumentError(f"messages[{i}]", f"must be a mapping with role and content; got {type(m).__name__}")
        check_chat_message(i, m.get("role"), m.get("content"))
        chat.messages.add(role=m["role"], content=m["content"])


def chat_from_pb(chat: generation_pb2.Chat) -> list[dict[str, str]]:
    """The turns of a Chat; raises InvalidArgumentError naming the first bad one
    (``messages`` when there are more than ``MAX_CHAT_MESSAGES``, else ``messages[1].role``)."""
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgumentError("messages", f"at most {MAX_CHAT_MESSAGES} chat messages, got {len(chat.messages)}")
    for i, m in enumerate(chat.messages):
        check_chat_message(i, m.role, m.content)
    return [{"role": m.role, "content": m.content} for m in chat.messages]


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
        eos_token_ids=list(info.eos_token_ids), num_workers=info.num_workers, block_size=info.block_size)


def model_info_from_pb(msg: generation_pb2.ModelInfoResponse) -> ModelInfo:
    return ModelInfo(model=msg.model, max_model_len=msg.max_model_len, vocab_size=msg.vocab_size,
                     eos_token_ids=tuple(msg.eos_token_ids), num_workers=msg.num_workers, block_size=msg.block_size)
