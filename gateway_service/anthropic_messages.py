"""Anthropic's Messages API on the gateway's HTTP server (``POST /v1/messages`` and
``/v1/messages/count_tokens``): its request bodies → the gateway's request objects, its answers
(whole, or as Anthropic's server-sent events) and its error shape.

A body becomes what the OpenAI chat API builds, with the same helpers: the chat turns (``system``
first, each message's content blocks as text, ``tool_use`` and ``tool_result`` blocks written as
:mod:`gateway_service.tool_calls` writes calls and results), the tools and ``tool_choice`` through
:func:`~gateway_service.tool_calls.parse_tools` (``any`` is our ``required``, ``tool`` a named
function), the sampling parameters through the OpenAI parser's checks, and one
:class:`~gateway_service.messages.GenerateInput` for the one ``GenerationService.generate`` path.
A final ``assistant`` message is Anthropic's prefill: the answer continues it
(``continue_final_message``). Fields a body leaves unset take the service's sampling defaults
(:func:`servicekit.sampling_defaults.unset_filled`).

Every key is mapped or refused by name (``thinking``, image and document blocks, server tools, an
unknown key: a 400 naming it), as the OpenAI parser does; ``null`` means "not given".

Pure but for :func:`message_events`, which reads a call's output queue.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from gateway_service.messages import GenerateChunk, GenerateInput, checked_user
from gateway_service.openai_params import _get, _renamed, _sampling, check_keys
from gateway_service.openai_responses import HTTP_STATUS, ChoiceState
from gateway_service.tool_calls import (
    ToolCall,
    ToolChoice,
    constraint,
    parse_tools,
    tool_call_text,
    tool_result_text,
    with_tools,
)
from servicekit.contract.chat import check_chat_message
from servicekit.contract.errors import InvalidArgumentError, PagedServeError
from servicekit.contract.prompt import check_text
from servicekit.contract.sampling_params import SamplingParams
from servicekit.sampling_defaults import unset_filled
from servicekit.serving import cancel_and_wait

# cache_control (here and on blocks): a prompt-caching hint, accepted: the prefix cache needs none
_CONVERSATION_KEYS = {"model", "system", "messages", "tools", "tool_choice", "thinking", "cache_control"}
MESSAGE_KEYS = frozenset(_CONVERSATION_KEYS | {"max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
                                               "metadata", "stream", "service_tier"})
COUNT_TOKENS_KEYS = frozenset(_CONVERSATION_KEYS)
SERVICE_TIERS = ("auto", "standard_only")  # one tier here: both mean "whatever serves it"
ROLES = ("user", "assistant")
# the keys a content block of each supported type may have besides "type"
_BLOCK_KEYS = {"text": ("text", "cache_control"), "tool_use": ("id", "name", "input", "cache_control"),
               "tool_result": ("tool_use_id", "content", "is_error", "cache_control")}
_BLOCK_ROLES = {"tool_use": "assistant", "tool_result": "user"}
_TOOL_KEYS = ("type", "name", "description", "input_schema", "cache_control")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": a named function
# the gateway's names for what a caller of this API names otherwise (generation's own checks)
_AS_SENT = {"stop": "stop_sequences", "prompt": "messages", "structured_output": "tool_choice"}

# The HTTP status a typed error travels as (the OpenAI routes', HTTP_STATUS) → Anthropic's status and
# error type for it: UNAVAILABLE (draining, no worker, Redis away) is Anthropic's 529 "overloaded";
# the rest keep their status, those not named here being "api_error".
_ANTHROPIC_STATUS = {400: (400, "invalid_request_error"), 401: (401, "authentication_error"),
                     403: (403, "permission_error"), 404: (404, "not_found_error"),
                     409: (409, "invalid_request_error"), 429: (429, "rate_limit_error"),
                     503: (529, "overloaded_error")}


def error_json(kind: str, message: str) -> dict:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(exc: PagedServeError) -> tuple[int, dict]:
    """(HTTP status, Anthropic's error shape) of a typed error."""
    status, _openai_type = HTTP_STATUS.get(exc.code, (500, ""))
    status, kind = _ANTHROPIC_STATUS.get(status, (status, "api_error"))
    return status, error_json(kind, str(exc))


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """One ``POST /v1/messages`` call: its one generation, and how to answer."""

    input: GenerateInput
    model: str
    message_id: str
    stream: bool = False

    echo_only: ClassVar[bool] = False  # read by the OpenAI routes' pump, which drives this call too

    def as_sent(self, exc: PagedServeError) -> PagedServeError:
        """``exc`` naming the field as this API's caller did (``stop_sequences``, ``messages``)."""
        return _renamed(exc, _AS_SENT)


def parse_message(body: Any, defaults: Mapping[str, float] | None = None) -> MessagesRequest:
    """A ``POST /v1/messages`` body; ``defaults``: the sampling parameters the fields it leaves unset
    take (``GenerationService.sampling_defaults``)."""
    body = _checked(body, MESSAGE_KEYS)
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise InvalidArgumentError("service_tier", f"must be {' or '.join(SERVICE_TIERS)}, got {tier!r}")
    user = _metadata(body)
    max_tokens = _get(body, "max_tokens", int)
    if max_tokens is None:
        raise InvalidArgumentError("max_tokens", "required: the most tokens to generate (an integer >= 1)")
    messages, tools, continued = _conversation(body)
    # the sampling keys as the OpenAI parser reads them (stop_sequences as its stop), defaults filled
    sampling = unset_filled({key: body.get(key) for key in ("temperature", "top_p", "top_k")}, defaults or {})
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidArgumentError("stop_sequences", "must be a list of strings")
    sampling["stop"] = stop
    try:
        params = _sampling(sampling, max_tokens, None, tool_constraint=None if tools is None else constraint(tools))
    except InvalidArgumentError as exc:
        raise _renamed(exc, _AS_SENT) from None
    request_id = uuid.uuid4().hex
    inp = GenerateInput(params, messages=messages, model=_get(body, "model", str, ""), request_id=request_id,
                        add_generation_prompt=not continued, continue_final_message=continued, tools=tools,
                        user=user)
    return MessagesRequest(inp, model=inp.model, message_id="msg_" + request_id,
                           stream=_get(body, "stream", bool, False))


def parse_count_tokens(body: Any) -> tuple[str, GenerateInput]:
    """A ``POST /v1/messages/count_tokens`` body: (model, the input whose prompt it counts: the chat
    as a message with the same body renders it)."""
    body = _checked(body, COUNT_TOKENS_KEYS)
    messages, tools, continued = _conversation(body)
    model = _get(body, "model", str, "")
    return model, GenerateInput(SamplingParams(max_tokens=1), messages=messages, model=model,
                                add_generation_prompt=not continued, continue_final_message=continued, tools=tools)


def _checked(body: Any, allowed: frozenset[str]) -> dict:
    """``body``'s keys all ``allowed`` (``service_tier`` aside: its values are this API's, checked by
    :func:`parse_message`); extended thinking only off."""
    check_keys({**body, "service_tier": None} if isinstance(body, dict) else body, allowed)
    if body.get("cache_control") is not None and not isinstance(body["cache_control"], dict):
        raise InvalidArgumentError("cache_control", "must be an object")
    thinking = body.get("thinking")
    if thinking is not None and thinking != {"type": "disabled"}:
        raise InvalidArgumentError("thinking", 'extended thinking is not supported (only {"type": "disabled"})')
    return body


def _metadata(body: dict) -> str:
    """Anthropic's ``metadata``: ``user_id``, the end user (returned: the request's tenant when
    the gateway has no API keys, as OpenAI's ``user``)."""
    metadata = _get(body, "metadata", dict, {})
    for key, value in metadata.items():
        if key != "user_id" and value is not None:
            raise InvalidArgumentError(f"metadata.{key}", "is not supported (only user_id)")
    if not isinstance(metadata.get("user_id", ""), (str, type(None))):
        raise InvalidArgumentError("metadata.user_id", "must be a string")
    return checked_user(metadata.get("user_id") or "", "metadata.user_id")


# -- the conversation --------------------------------------------------------------------------------

def _conversation(body: dict) -> tuple[list[dict[str, str]], ToolChoice | None, bool]:
    """The body's chat turns (the tools described first), its tools, and whether the answer
    continues its last turn (a final assistant message with text: Anthropic's prefill)."""
    turns = [*_system(body.get("system")), *_turns(body.get("messages"))]
    continued = turns[-1]["role"] == "assistant"
    if continued and not turns[-1]["content"]:  # an empty final assistant turn: an answer from the start
        turns, continued = turns[:-1], False
    tools = _tools(body)
    return (turns if tools is None else with_tools(turns, tools)), tools, continued


def _system(system: Any) -> list[dict[str, str]]:
    """The ``system`` prompt (a string, or text blocks joined by newlines) as a system turn."""
    if system is None:
        return []
    if isinstance(system, list):
        text = "\n".join(_text_block(f"system[{k}]", block) for k, block in enumerate(system))
    elif isinstance(system, str):
        text = system
    else:
        raise InvalidArgumentError("system", "must be a string or a list of text blocks")
    check_text("system", text)
    return [{"role": "system", "content": text}] if text else []


def _text_block(where: str, block: Any) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise InvalidArgumentError(f"{where}.type", "only text blocks are supported here")
    return _block(where, "", block)


def _turns(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages", "required: a non-empty list")
    return [_turn(f"messages[{i}]", i, message) for i, message in enumerate(messages)]


def _turn(where: str, index: int, message: Any) -> dict[str, str]:
    """One message as a chat turn: its content blocks' text joined by newlines."""
    if not isinstance(message, dict):
        raise InvalidArgumentError(where, "must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        said = " (a system prompt is the top-level system)" if role == "system" else ""
        raise InvalidArgumentError(f"{where}.role", f"must be user or assistant{said}; got {role!r}")
    for key, value in message.items():
        if key not in ("role", "content") and value is not None:
            raise InvalidArgumentError(f"{where}.{key}", "is not supported")
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(_block(f"{where}.content[{k}]", role, block) for k, block in enumerate(content))
    check_chat_message(index, role, content)
    return {"role": role, "content": content}


def _block(where: str, role: str, block: Any) -> str:
    """A content block as the model reads it: its text, a ``tool_use`` as the model writes a call,
    a ``tool_result`` in ``<tool_response>`` tags (an error's prefixed ``Error:``). ``role``: the
    message's ("": the system prompt's, text only)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in _BLOCK_KEYS:
        raise InvalidArgumentError(f"{where}.type", f"{kind!r} blocks are not supported (only text, tool_use and "
                                                    "tool_result)")
    for key, value in block.items():
        if key != "type" and key not in _BLOCK_KEYS[kind] and value is not None:
            raise InvalidArgumentError(f"{where}.{key}", "is not supported")
    if _BLOCK_ROLES.get(kind, role) != role:
        raise InvalidArgumentError(f"{where}.type", f"{kind} blocks belong to {_BLOCK_ROLES[kind]} messages")
    if block.get("cache_control") is not None and not isinstance(block["cache_control"], dict):
        raise InvalidArgumentError(f"{where}.cache_control", "must be an object")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise InvalidArgumentError(f"{where}.text", "required: a string")
        return block["text"]
    if kind == "tool_use":
        if not isinstance(block.get("name"), str):
            raise InvalidArgumentError(f"{where}.name", "required: the tool's name")
        arguments = block.get("input")
        if not isinstance(arguments, dict):
            raise InvalidArgumentError(f"{where}.input", "required: an object (the tool's input)")
        return tool_call_text(block["name"], arguments)
    result = block.get("content")
    if isinstance(result, list):
        result = "\n".join(_text_block(f"{where}.content[{k}]", part) for k, part in enumerate(result))
    elif result is None:
        result = ""
    elif not isinstance(result, str):
        raise InvalidArgumentError(f"{where}.content", "must be a string or a list of text blocks")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise InvalidArgumentError(f"{where}.is_error", "must be a boolean")
    return tool_result_text("Error: " + result if is_error else result)


# -- tools -------------------------------------------------------------------------------------------

def _tools(body: dict) -> ToolChoice | None:
    """The body's ``tools`` and ``tool_choice``, read as OpenAI's by
    :func:`~gateway_service.tool_calls.parse_tools`, errors naming the fields as sent."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise InvalidArgumentError("tools", "must be a list of tools")
    functions = [_function(i, tool) for i, tool in enumerate(raw or [])]
    choice, parallel = _tool_choice(body.get("tool_choice"))
    names = {"tool_choice.function.name": "tool_choice.name"}
    for i in range(len(functions)):
        names.update({f"tools[{i}].function.{ours}": f"tools[{i}].{theirs}" for ours, theirs in
                      (("name", "name"), ("description", "description"), ("parameters", "input_schema"))})
    try:
        return parse_tools({"tools": functions, "tool_choice": choice, "parallel_tool_calls": parallel})
    except InvalidArgumentError as exc:
        raise _renamed(exc, names) from None


def _function(i: int, tool: Any) -> dict:
    """A custom tool (``name``, ``description``, ``input_schema``) as OpenAI's function tool."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise InvalidArgumentError(where, "must be an object with name, description and input_schema")
    if tool.get("type") not in (None, "custom"):
        raise InvalidArgumentError(f"{where}.type", f"server tools ({tool['type']!r}) are not supported; only custom "
                                                    "tools (name, description, input_schema)")
    for key, value in tool.items():
        if key not in _TOOL_KEYS and value is not None:
            raise InvalidArgumentError(f"{where}.{key}", "is not supported")
    if tool.get("input_schema") is None:
        raise InvalidArgumentError(f"{where}.input_schema", "required: the tool's input as a JSON Schema object")
    return {"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description"),
                                             "parameters": tool["input_schema"]}}


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """Anthropic's ``tool_choice`` as OpenAI's (and its ``parallel_tool_calls``)."""
    if choice is None:
        return None, None
    if not isinstance(choice, dict):
        raise InvalidArgumentError("tool_choice", 'must be an object: {"type": "auto"}, {"type": "any"}, '
                                                  '{"type": "tool", "name": ...} or {"type": "none"}')
    for key, value in choice.items():
        if key not in ("type", "name", "disable_parallel_tool_use") and value is not None:
            raise InvalidArgumentError(f"tool_choice.{key}", "is not supported")
    kind, name, disable = choice.get("type"), choice.get("name"), choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise InvalidArgumentError("tool_choice.disable_parallel_tool_use", "must be a boolean")
    parallel = None if disable is None else not disable
    if kind == "tool":
        if not isinstance(name, str):
            raise InvalidArgumentError("tool_choice.name", "required with type tool: the tool to call")
        return {"type": "function", "function": {"name": name}}, parallel
    if kind not in _TOOL_CHOICES:
        raise InvalidArgumentError("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")
    if name is not None:
        raise InvalidArgumentError("tool_choice.name", "only with type tool")
    return _TOOL_CHOICES[kind], parallel


# -- answers -----------------------------------------------------------------------------------------

def tool_use_id(call: ToolCall) -> str:
    """A call's id as Anthropic's clients expect one (``toolu_...``; ours are ``call_...``)."""
    return "toolu_" + call.id.removeprefix("call_")


def tool_use_json(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": json.loads(call.arguments)}


def stop_reason(choice: ChoiceState) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a finished answer."""
    if choice.tool_calls:
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):  # a stop string (not in the text)
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def _usage(choice: ChoiceState) -> dict:
    """Every prompt token (prefix-cache hits included) and the generated ones."""
    if choice.usage is None:
        return {"input_tokens": choice.num_prompt_tokens, "output_tokens": len(choice.token_ids)}
    return {"input_tokens": choice.usage.prompt_tokens, "output_tokens": choice.usage.completion_tokens}


def _head(message_id: str, model: str) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model}


def message_json(message_id: str, model: str, choice: ChoiceState) -> dict:
    """The whole answer: a text block (when there is text), then one ``tool_use`` block per call."""
    text = "".join(choice.text)
    reason, sequence = stop_reason(choice)
    content = [{"type": "text", "text": text}] if text else []
    return {**_head(message_id, model), "content": content + [tool_use_json(c) for c in choice.tool_calls],
            "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(choice)}


def sse(kind: str, data: dict) -> bytes:
    """One server-sent event as Anthropic names them (``event:`` is the payload's type)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n".encode()


class MessageEvents:
    """One streamed answer's events: ``message_start`` (and a ``ping``), a text block opened at the
    first text and its ``text_delta`` events, then at the end the text block closed, each call as a
    ``tool_use`` block with its input as one ``input_json_delta``, ``message_delta`` (the stop reason
    and usage) and ``message_stop``. Its blocks concatenate to :func:`message_json`'s."""

    def __init__(self, message_id: str, model: str) -> None:
        self._id = message_id
        self._model = model
        self._choice = ChoiceState(0)
        self._blocks = 0  # content blocks started
        self._text_open = False

    def start(self, first: GenerateChunk) -> list[bytes]:
        message = {**_head(self._id, self._model), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": first.num_prompt_tokens, "output_tokens": 0}}
        return [sse("message_start", {"message": message}), sse("ping", {})]

    def take(self, chunk: GenerateChunk) -> list[bytes]:
        text, _logprobs, _ids = self._choice.add(chunk)
        events = []
        if text:
            if not self._text_open:
                events.append(self._block_start({"type": "text", "text": ""}))
                self._text_open = True
            events.append(sse("content_block_delta", {"index": self._blocks - 1,
                                                      "delta": {"type": "text_delta", "text": text}}))
        if chunk.finish_reason is None:
            return events
        if self._text_open:
            events.append(sse("content_block_stop", {"index": self._blocks - 1}))
        for call in self._choice.tool_calls:
            events.append(self._block_start({"type": "tool_use", "id": tool_use_id(call), "name": call.name,
                                             "input": {}}))
            events.append(sse("content_block_delta", {"index": self._blocks - 1, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}))
            events.append(sse("content_block_stop", {"index": self._blocks - 1}))
        reason, sequence = stop_reason(self._choice)
        events.append(sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": _usage(self._choice)}))
        events.append(sse("message_stop", {}))
        return events

    def _block_start(self, block: dict) -> bytes:
        self._blocks += 1
        return sse("content_block_start", {"index": self._blocks - 1, "content_block": block})


async def message_events(first: tuple[int, Any], queue: asyncio.Queue, events: MessageEvents,
                         tasks: list[asyncio.Task]) -> AsyncIterator[bytes]:
    """The SSE stream of a call whose first queue item (``(0, chunk)``) is ``first``; the pump in
    ``tasks`` fills ``queue`` with ``(0, chunk)``, then ``(0, None)`` or ``(0, error)``. An error after
    the first event is Anthropic's ``error`` event. Cancelled (the client left), it cancels the pump,
    which aborts the request."""
    try:
        yield b"".join(events.start(first[1]))
        item = first
        while True:
            payload = item[1]
            if isinstance(payload, PagedServeError):
                yield sse("error", {"error": error_body(payload)[1]["error"]})
                break
            if payload is None:
                break
            for event in events.take(payload):
                yield event
            item = await queue.get()
    finally:
        await cancel_and_wait(tasks)
