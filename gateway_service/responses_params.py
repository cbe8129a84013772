"""OpenAI Responses API bodies (``POST /v1/responses``) → the chat path's request, checked field by
field.

A Responses body is a chat in other words: its ``input`` items (messages, ``function_call`` and
``function_call_output`` items), ``instructions`` and the conversation of ``previous_response_id``
become chat turns; ``tools`` (the flat shape), ``tool_choice``, ``text.format`` and
``max_output_tokens`` become chat's ``tools``, ``tool_choice``, ``response_format`` and
``max_completion_tokens``. The chat body is then read by :func:`~gateway_service.openai_params.parse_chat`,
the one reader of chat requests, so tools, structured output and every range check are the chat
API's; its errors are renamed back to the fields the caller sent (:func:`as_sent`). A field this
server cannot honour (a built-in tool, ``reasoning`` effort, ``conversation``, ...) is a 400 naming
it, never dropped. ``null`` means "not given", as everywhere in the OpenAI API.

Pure: no I/O, so the rules are tested without a server.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway_service.messages import checked_user
from servicekit.contract.errors import InvalidArgumentError, PagedServeError

RESPONSE_ID_RE = re.compile(r"resp_[0-9a-f]{32}")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds

KEYS = frozenset({"model", "input", "instructions", "previous_response_id", "store", "background", "stream",
                  "stream_options", "max_output_tokens", "temperature", "top_p", "text", "tools", "tool_choice",
                  "parallel_tool_calls", "metadata", "user", "reasoning", "include", "truncation", "service_tier",
                  "top_logprobs"})
# Keys accepted only with the value that means "off" (the behaviour this server has).
_OFF_ONLY: dict[str, tuple[Any, ...]] = {"include": ([],), "truncation": ("disabled",),
                                         "service_tier": ("auto", "default"), "top_logprobs": (0,)}
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_ITEM_KEYS = {"message": ("type", "role", "content", "id", "status"),
              "function_call": ("type", "call_id", "name", "arguments", "id", "status"),
              "function_call_output": ("type", "call_id", "output", "id", "status")}
_PART_KEYS = ("type", "text", "annotations", "logprobs")
_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
_FORMAT_KEYS = {"text": ("type",), "json_object": ("type",),
                "json_schema": ("type", "name", "schema", "description", "strict")}


@dataclass(frozen=True, slots=True)
class ResponseRequest:
    """One ``POST /v1/responses`` body, checked. ``input_items``: the input as items (a string
    input is one user message), each with an ``id``; ``settings``: the fields the response object
    repeats (``tools`` in the flat shape, ``text``, ``tool_choice``, ...)."""

    response_id: str
    input_items: list[dict]
    model: str = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] = field(default_factory=list)
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    text_format: dict = field(default_factory=lambda: {"type": "text"})
    metadata: dict = field(default_factory=dict)
    user: str | None = None


def new_response_id() -> str:
    import uuid

    return "resp_" + uuid.uuid4().hex


def item_id(prefix: str, response_id: str, where: str) -> str:
    """An item's id, derived from its response and place, so every gateway names it alike."""
    return prefix + hashlib.sha256(f"{response_id}/{where}".encode()).hexdigest()[:32]


def _get(body: dict, key: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    kinds_t = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds_t) or (isinstance(value, bool) and bool not in kinds_t):
        names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
                 dict: "an object"}
        raise InvalidArgumentError(key, f"must be {' or '.join(dict.fromkeys(names[k] for k in kinds_t))}")
    return value


def _check_keys(where: str, value: dict, allowed: tuple[str, ...] | frozenset[str]) -> None:
    for key, inner in value.items():
        if key not in allowed and inner is not None:
            raise InvalidArgumentError(f"{where}.{key}" if where else key, "is not a supported parameter")


def parse_response(body: Any, response_id: str) -> ResponseRequest:
    """A ``POST /v1/responses`` body, checked; ``response_id`` names the response (and its items)."""
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    _check_keys("", body, KEYS)
    for key, off in _OFF_ONLY.items():
        value = body.get(key)
        if value is not None and not any(type(value) is type(v) and value == v for v in off):
            raise InvalidArgumentError(key, f"is not supported (only {' or '.join(map(repr, off))})")
    _check_reasoning(body.get("reasoning"))
    store = _get(body, "store", bool, True)
    background = _get(body, "background", bool, False)
    if background and not store:
        raise InvalidArgumentError("background", "requires store: true (a background response is read back later)")
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    if options and not stream:
        raise InvalidArgumentError("stream_options", "only allowed with stream: true")
    _check_keys("stream_options", options, ("include_obfuscation",))  # obfuscation pads events; none here
    previous = _get(body, "previous_response_id", str)
    if previous is not None and not RESPONSE_ID_RE.fullmatch(previous):
        raise InvalidArgumentError("previous_response_id", f"is not a response id: {previous[:80]!r}")
    max_output = _get(body, "max_output_tokens", int)
    if max_output is not None and max_output < 1:
        raise InvalidArgumentError("max_output_tokens", f"must be >= 1, got {max_output}")
    tools = [_tool(i, t) for i, t in enumerate(_get(body, "tools", list, []))]
    user = _get(body, "user", str)
    return ResponseRequest(
        response_id=response_id, input_items=_input_items(body.get("input"), response_id), model=_get(body, "model", str, ""),
        instructions=_get(body, "instructions", str), previous_response_id=previous, store=store,
        background=background, stream=stream, max_output_tokens=max_output,
        temperature=_get(body, "temperature", (int, float)), top_p=_get(body, "top_p", (int, float)), tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice")), parallel_tool_calls=_get(body, "parallel_tool_calls", bool, True),
        text_format=_text_format(_get(body, "text", dict, {})), metadata=_metadata(body.get("metadata")),
        user=None if user is None else checked_user(user))


def _check_reasoning(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or any(v is not None for v in value.values()):
        raise InvalidArgumentError("reasoning", "is not supported: the served model has no reasoning effort or "
                                                "summary to set (leave it out, or null)")


def _metadata(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise InvalidArgumentError("metadata", f"must be an object of at most {MAX_METADATA_PAIRS} pairs")
    for key, inner in value.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(inner, str) or len(inner) > MAX_METADATA_VALUE:
            raise InvalidArgumentError(f"metadata.{key[:MAX_METADATA_KEY]}",
                                       f"keys are at most {MAX_METADATA_KEY} characters, values strings of at most "
                                       f"{MAX_METADATA_VALUE}")
    return dict(value)


# -- input items -------------------------------------------------------------------------------------

def _input_items(value: Any, response_id: str) -> list[dict]:
    """``input`` as normalized items: a message's content as text parts, each item with an id."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidArgumentError("input", "must be a string or a list of items")
    return [_item(f"input[{i}]", item, response_id, i) for i, item in enumerate(value)]


def _item(where: str, item: Any, response_id: str, index: int) -> dict:
    if not isinstance(item, dict):
        raise InvalidArgumentError(where, "must be an object")
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind not in _ITEM_KEYS:
        raise InvalidArgumentError(f"{where}.type", "must be message, function_call or function_call_output "
                                                    f"(other items are not supported), got {kind!r}")
    _check_keys(where, item, _ITEM_KEYS[kind])
    given_id = item.get("id")
    if given_id is not None and not isinstance(given_id, str):
        raise InvalidArgumentError(f"{where}.id", "must be a string")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidArgumentError(f"{where}.role", f"must be one of {', '.join(_ROLES)}; got {role!r}")
        out = {"id": given_id or item_id("msg_", response_id, f"in/{index}"), "type": "message", "role": role,
               "status": "completed", "content": _content(where, item.get("content"), role)}
        return out
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidArgumentError(f"{where}.call_id", "required: a string")
    if kind == "function_call":
        name, arguments = item.get("name"), item.get("arguments")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"{where}.name", "required: a string")
        if not isinstance(arguments, str):
            raise InvalidArgumentError(f"{where}.arguments", "required: JSON text")
        try:
            json.loads(arguments or "{}")
        except ValueError:
            raise InvalidArgumentError(f"{where}.arguments", "must be JSON text") from None
        return {"id": given_id or item_id("fc_", response_id, f"in/{index}"), "type": "function_call",
                "status": "completed", "call_id": call_id, "name": name, "arguments": arguments}
    output = item.get("output")
    if isinstance(output, list):
        output = "\n".join(p["text"] for p in _parts(f"{where}.output", output))
    if not isinstance(output, str):
        raise InvalidArgumentError(f"{where}.output", "required: a string or a list of text parts")
    return {"id": given_id or item_id("fco_", response_id, f"in/{index}"), "type": "function_call_output",
            "status": "completed", "call_id": call_id, "output": output}


def _content(where: str, content: Any, role: str) -> list[dict]:
    """A message's content as text parts (a string is one part)."""
    if isinstance(content, str):
        return [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    if not isinstance(content, list):
        raise InvalidArgumentError(f"{where}.content", "required: a string or a list of text parts")
    return _parts(f"{where}.content", content)


def _parts(where: str, parts: list) -> list[dict]:
    out = []
    for k, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else None
            raise InvalidArgumentError(f"{where}[{k}].type", f"only text parts (input_text, output_text) are "
                                                             f"supported, got {kind!r}")
        _check_keys(f"{where}[{k}]", part, _PART_KEYS)
        if not isinstance(part.get("text"), str):
            raise InvalidArgumentError(f"{where}[{k}].text", "required: a string")
        out.append({"type": part["type"], "text": part["text"]})
    return out


# -- tools and formats -------------------------------------------------------------------------------

def _tool(i: int, tool: Any) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise InvalidArgumentError(where, "must be an object")
    if tool.get("type") != "function":
        raise InvalidArgumentError(f"{where}.type", f"{tool.get('type')!r}: built-in tools (web search, file search, "
                                                    "computer use, code interpreter, MCP, ...) are not supported, "
                                                    "only type function")
    _check_keys(where, tool, _TOOL_KEYS)
    if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
        raise InvalidArgumentError(f"{where}.strict", "must be a boolean")
    return {key: tool.get(key) for key in _TOOL_KEYS if key != "strict"} | {"strict": tool.get("strict", True)}


def _tool_choice(value: Any) -> str | dict:
    if value is None:
        return "auto"
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        _check_keys("tool_choice", value, ("type", "name"))
        if not isinstance(value.get("name"), str):
            raise InvalidArgumentError("tool_choice.name", "required: the name of one of the tools")
        return {"type": "function", "name": value["name"]}
    raise InvalidArgumentError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                                              '"name": ...} (other choices are not supported)')


def _text_format(text: dict) -> dict:
    _check_keys("text", text, ("format",))
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in _FORMAT_KEYS:
        raise InvalidArgumentError("text.format.type", "must be text, json_object or json_schema")
    _check_keys("text.format", fmt, _FORMAT_KEYS[fmt["type"]])
    return {k: v for k, v in fmt.items() if v is not None}


# -- the chat it is ----------------------------------------------------------------------------------

def conversation_turns(items: list[dict], labels: list[str]) -> tuple[list[dict], list[str]]:
    """Conversation items as chat turns (the shapes ``parse_chat`` reads) and, per turn, the label
    of the item it came from (``labels[i]`` names ``items[i]``): a message is a turn of its role,
    ``function_call`` items join the assistant turn before them (or make one), a
    ``function_call_output`` is a ``tool`` turn."""
    turns: list[dict] = []
    sources: list[str] = []
    for item, label in zip(items, labels):
        kind = item["type"]
        if kind == "message":
            turns.append({"role": item["role"], "content": "\n".join(p["text"] for p in item["content"])})
            sources.append(label)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if turns and turns[-1]["role"] == "assistant":
                turns[-1].setdefault("tool_calls", []).append(call)
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
                sources.append(label)
        elif kind == "function_call_output":
            turns.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            sources.append(label)
    return turns, sources


def chat_body(req: ResponseRequest, history: list[dict]) -> tuple[dict, list[str]]:
    """The chat request ``req`` is (``history``: the items of its ``previous_response_id``'s
    conversation, its output last), and the label of each turn's source for :func:`as_sent`."""
    items = history + req.input_items
    labels = ["previous_response_id"] * len(history) + [f"input[{i}]" for i in range(len(req.input_items))]
    turns, sources = conversation_turns(items, labels)
    if req.instructions is not None:
        turns, sources = [{"role": "system", "content": req.instructions}, *turns], ["instructions", *sources]
    body: dict[str, Any] = {"model": req.model or None, "messages": turns, "max_completion_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p,
                            "parallel_tool_calls": req.parallel_tool_calls, "user": req.user}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if t.get(k) is not None}} for t in req.tools]
    choice = req.tool_choice
    if req.tools or choice not in ("auto", "none"):  # chat refuses a choice without tools; auto is the default
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict) \
            else choice
    # a required or named tool choice makes the output calls, which a text format does not apply to
    constrained = req.tools and (choice == "required" or isinstance(choice, dict))
    if req.text_format["type"] != "text" and not constrained:
        fmt = req.text_format
        body["response_format"] = {"type": fmt["type"]} if fmt["type"] == "json_object" else {
            "type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return {k: v for k, v in body.items() if v is not None}, sources


# chat's field names (a prefix of the field) → the Responses API's
_RENAMES = (
    (re.compile(r"^(?:max_completion_tokens|max_tokens)\b"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\b"), "text.format"),
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^structured_output\b"), "text.format"),
    (re.compile(r"^(tools\[\d+\])\.function\b"), r"\1"),
    (re.compile(r"^tool_choice\.function\b"), "tool_choice"),
    (re.compile(r"^(?:prompt_token_ids|prompt|messages)$"), "input"),
)
_TURN = re.compile(r"^messages\[(\d+)\]")


def responses_field(name: str, sources: list[str]) -> str:
    """A chat field name (``messages[3].content``) as the caller wrote it (``input[2].content``)."""
    turn = _TURN.match(name)
    if turn is not None:
        k = int(turn.group(1))
        return (sources[k] if k < len(sources) else "input") + name[turn.end():]
    for pattern, replacement in _RENAMES:
        if pattern.search(name):
            return pattern.sub(replacement, name, count=1)
    return name


def as_sent(exc: PagedServeError, sources: list[str]) -> PagedServeError:
    """``exc`` naming its field as the caller of the Responses API sent it."""
    old = getattr(exc, "field", "")
    if not isinstance(exc, InvalidArgumentError) or not old:
        return exc
    new = responses_field(old, sources)
    return exc if new == old else InvalidArgumentError(new, exc.message.replace(old, new))
