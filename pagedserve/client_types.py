"""What the client SDK returns: plain frozen dataclasses, no protobuf (``ModelInfo`` and ``Usage``
are the gateway's own, from ``servicekit.contract.api``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from servicekit.contract.api import ModelInfo, Usage
from servicekit.contract.step import TokenLogprobs

__all__ = ["Chunk", "Completion", "ModelInfo", "TokenLogprobs", "ToolCall", "Usage"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of one of the chat's tools, as the answer made it."""

    id: str  # the same on every gateway; a "tool" turn answering it names it as tool_call_id
    name: str
    arguments: str  # a JSON object, as text

    @property
    def args(self) -> dict:
        """The arguments, parsed."""
        return json.loads(self.arguments)

    def message(self) -> dict:
        """The call as an assistant turn's ``tool_calls`` entry (OpenAI's shape), for the history."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed response."""

    request_id: str
    text: str  # new text (never half a character, never part of a stop string)
    token_ids: tuple[int, ...]  # new token ids
    first_index: int  # output index of token_ids[0]
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token when asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "tool_calls" on the last chunk
    usage: Usage | None = None  # on the last chunk
    stop_string: str = ""  # the stop string that ended the request, if one did
    stop_token_id: int | None = None  # the stop_token_ids entry that ended it, if one did (its text not in text)
    # on the chunk with the first token, when prompt_logprobs was asked for: one per prompt token
    # after the first
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()  # a chat with tools: on the last chunk, the calls its answer made


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation (``generate`` / ``chat``): the chunks of a stream joined."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None
    logprobs: tuple[TokenLogprobs, ...] = ()
    stop_string: str = ""
    stop_token_id: int | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # when asked for: one per prompt token after the first
    tool_calls: tuple[ToolCall, ...] = ()  # a chat with tools: the calls the answer made (text is the rest)

    @classmethod
    def from_chunks(cls, chunks: list[Chunk]) -> Completion:
        last = chunks[-1]
        return cls(
            request_id=last.request_id, text="".join(c.text for c in chunks),
            token_ids=tuple(t for c in chunks for t in c.token_ids), finish_reason=last.finish_reason,
            usage=last.usage, logprobs=tuple(lp for c in chunks for lp in c.logprobs), stop_string=last.stop_string,
            stop_token_id=last.stop_token_id, tool_calls=last.tool_calls,
            prompt_logprobs=next((c.prompt_logprobs for c in chunks if c.prompt_logprobs), ()))

