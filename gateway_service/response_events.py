"""The Responses API's response objects and stream events: the events of one response, made from
its generation's chunks, and the response object that any prefix of those events stands for.

Every event passes through :meth:`ResponseState.apply`, the one transition of a response's state,
whether a producer just made it or a reader replays it from the stored log: so the object a
reader rebuilds from events ``0..n`` is the object the producer had after event ``n``, and a
producer that takes a response over (its first producer died) replays the log and goes on from
its last event.

A response's events are a log, not a function of how its chunks happened to be cut: the admitting
gateway reads a request's tokens a step at a time, a resume reads many steps at once, so two
readers of one generation see different chunks. What does not depend on the cut is the text:
every reader's content is a prefix of the same final content (the tool-call reader holds back the
same text whatever the chunks). :class:`ResponseBuilder` therefore emits what its reader's text
adds beyond what the log already holds, so a takeover continues the log where it ended, never
repeating or changing an event.

Pure: no I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gateway_service.messages import GenerateChunk
from gateway_service.responses_params import ResponseRequest, item_id
from servicekit.contract.api import Usage
from servicekit.contract.errors import PagedServeError
from servicekit.contract.step import FinishReason

TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})
_WITH_RESPONSE = frozenset({"response.created", "response.queued", "response.in_progress", "response.completed",
                            "response.incomplete", "response.failed", "response.cancelled"})
_ERROR_CODES = {"INVALID_ARGUMENT": "invalid_prompt", "RESOURCE_EXHAUSTED": "rate_limit_exceeded"}


def response_head(req: ResponseRequest, *, model: str, temperature: float, top_p: float) -> dict:
    """A new response's object: what it repeats of its request, nothing generated yet."""
    return {"id": req.response_id, "object": "response", "created_at": int(time.time()),
            "status": "queued" if req.background else "in_progress", "background": req.background, "error": None,
            "incomplete_details": None, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "model": model, "output": [], "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": req.store, "temperature": temperature,
            "text": {"format": req.text_format}, "tool_choice": req.tool_choice, "tools": req.tools, "top_p": top_p,
            "truncation": "disabled", "usage": None, "user": req.user, "metadata": req.metadata, "completed_at": None}


def usage_json(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


@dataclass(slots=True)
class OutputItem:
    """One item of a response's output: a message (``text``: its output text) or a function call
    (``text``: its arguments)."""

    kind: str
    id: str
    text: str = ""
    name: str = ""
    call_id: str = ""
    status: str = "in_progress"
    part_added: bool = False  # a message's output_text part was added

    @classmethod
    def of(cls, item: dict) -> OutputItem:
        if item["type"] == "message":
            parts = item.get("content") or []
            return cls("message", item["id"], parts[0]["text"] if parts else "", status=item["status"],
                       part_added=bool(parts))
        return cls("function_call", item["id"], item["arguments"], item["name"], item["call_id"], item["status"])

    def json(self, *, ended: bool = False) -> dict:
        """The item; ``ended``: its response ended (an item still in progress shows as incomplete)."""
        status = "incomplete" if ended and self.status == "in_progress" else self.status
        if self.kind == "message":
            content = [_text_part(self.text)] if self.part_added else []
            return {"id": self.id, "type": "message", "status": status, "role": "assistant", "content": content}
        return {"id": self.id, "type": "function_call", "status": status, "call_id": self.call_id, "name": self.name,
                "arguments": self.text}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseState:
    """A response as its events so far leave it; ``head`` is its object's fixed part."""

    def __init__(self, head: dict) -> None:
        self.head = dict(head)
        self.items: list[OutputItem] = []
        self.next_seq = 0

    @classmethod
    def replay(cls, head: dict, events: list[dict]) -> ResponseState:
        state = cls(head)
        for event in events:
            state.apply(event)
        return state

    @property
    def status(self) -> str:
        return self.head["status"]

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL

    def apply(self, event: dict) -> None:
        """Take event number ``next_seq`` (a gap or a repeat is a bug: ValueError)."""
        if event["sequence_number"] != self.next_seq:
            raise ValueError(f"event {event['sequence_number']} applied after {self.next_seq - 1}")
        kind = event["type"]
        if kind in _WITH_RESPONSE:
            self.head.update({k: v for k, v in event["response"].items() if k != "output"})
        elif kind == "response.output_item.added":
            self.items.append(OutputItem.of(event["item"]))
        elif kind == "response.content_part.added":
            self.items[event["output_index"]].part_added = True
        elif kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            self.items[event["output_index"]].text += event["delta"]
        elif kind == "response.output_item.done":
            self.items[event["output_index"]] = OutputItem.of(event["item"])
        self.next_seq += 1

    def object(self, **changes: Any) -> dict:
        """The response object now (``changes``: fields set on top, as a terminal event sets them)."""
        head = {**self.head, **changes}
        ended = head["status"] in TERMINAL
        return {**head, "output": [item.json(ended=ended) for item in self.items]}


class ResponseBuilder:
    """Makes one response's events from its generation's chunks, on top of ``state`` (empty for a
    new response, replayed from the log for a takeover): each method returns the new events, already
    applied to ``state``."""

    def __init__(self, state: ResponseState) -> None:
        self.state = state
        self._content = ""  # this reader's content text so far

    @property
    def response_id(self) -> str:
        return self.state.head["id"]

    def _emit(self, out: list[dict], kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": self.state.next_seq, **fields}
        self.state.apply(event)
        out.append(event)

    def start(self) -> list[dict]:
        """``response.created`` and ``response.in_progress`` (none when the log has them)."""
        out: list[dict] = []
        if self.state.next_seq == 0:
            self._emit(out, "response.created", response=self.state.object())
            self._emit(out, "response.in_progress", response=self.state.object(status="in_progress"))
        return out

    def take(self, chunk: GenerateChunk, *, cancelled: bool = False) -> list[dict]:
        """The events ``chunk`` adds; with its last chunk the items close and the response ends
        (``cancelled``: a cancel was asked, so an aborted generation ends ``cancelled``)."""
        out: list[dict] = []
        self._content += chunk.text
        self._add_text(out)
        if chunk.finish_reason is not None:
            self._finish(out, chunk, cancelled)
        return out

    def _message(self) -> tuple[int, OutputItem] | None:
        for index, item in enumerate(self.state.items):
            if item.kind == "message":
                return index, item
        return None

    def _open_message(self, out: list[dict]) -> tuple[int, OutputItem]:
        found = self._message()
        if found is not None:
            return found
        index = len(self.state.items)
        new_id = item_id("msg_", self.response_id, f"out/{index}")
        self._emit(out, "response.output_item.added", output_index=index,
                   item={"id": new_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []})
        self._emit(out, "response.content_part.added", item_id=new_id, output_index=index, content_index=0,
                   part=_text_part(""))
        return index, self.state.items[index]

    def _add_text(self, out: list[dict]) -> None:
        found = self._message()
        sent = found[1].text if found is not None else ""
        if len(self._content) <= len(sent):
            return  # the log has this already (a takeover catching up)
        index, item = self._open_message(out)
        self._emit(out, "response.output_text.delta", item_id=item.id, output_index=index, content_index=0,
                   delta=self._content[len(sent):], logprobs=[])

    def _finish(self, out: list[dict], chunk: GenerateChunk, cancelled: bool) -> None:
        reason = chunk.finish_reason
        status = {FinishReason.STOP: "completed", FinishReason.LENGTH: "incomplete"}.get(
            reason, "cancelled" if cancelled else "failed")
        item_status = "incomplete" if status == "incomplete" else "completed"
        found = self._message()
        if found is None and not chunk.tool_calls:
            found = self._open_message(out)  # an answer with no text is one empty message
        if found is not None and found[1].status == "in_progress":
            index, item = found
            self._emit(out, "response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                       text=item.text, logprobs=[])
            self._emit(out, "response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                       part=_text_part(item.text))
            self._emit(out, "response.output_item.done", output_index=index,
                       item=OutputItem("message", item.id, item.text, status=item_status, part_added=True).json())
        for call in chunk.tool_calls:
            index = len(self.state.items)
            call_item = OutputItem("function_call", item_id("fc_", self.response_id, f"out/{index}"), "", call.name,
                                   call.id)
            self._emit(out, "response.output_item.added", output_index=index, item=call_item.json())
            self._emit(out, "response.function_call_arguments.delta", item_id=call_item.id, output_index=index,
                       delta=call.arguments)
            self._emit(out, "response.function_call_arguments.done", item_id=call_item.id, output_index=index,
                       name=call.name, arguments=call.arguments)
            call_item.text, call_item.status = call.arguments, "completed"
            self._emit(out, "response.output_item.done", output_index=index, item=call_item.json())
        changes: dict[str, Any] = {"status": status, "completed_at": int(time.time())}
        if chunk.usage is not None:
            changes["usage"] = usage_json(chunk.usage)
        if status == "incomplete":
            changes["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "failed":
            changes["error"] = {"code": "server_error", "message": "the generation was aborted"}
        self._emit(out, f"response.{status}", response=self.state.object(**changes))

    def fail(self, exc: PagedServeError) -> list[dict]:
        """The events of a generation that ended with an error: ``response.failed``."""
        out: list[dict] = []
        error = {"code": _ERROR_CODES.get(exc.code, "server_error"), "message": str(exc)}
        self._emit(out, "response.failed", response=self.state.object(status="failed", error=error))
        return out

    def cancel(self) -> list[dict]:
        """The events of a response cancelled with no generation to say so: ``response.cancelled``."""
        out: list[dict] = []
        self._emit(out, "response.cancelled", response=self.state.object(status="cancelled"))
        return out
