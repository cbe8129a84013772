"""OpenAI tool calling on ``/v1/chat/completions``: the tools and ``tool_choice`` of a body, how
they reach the model, and how its output becomes ``tool_calls``.

- **Prompt.** The tools are described to the model in a system turn (their JSON schemas, and the
  format to answer in: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), added before
  the conversation, the same for every chat template; an assistant turn's ``tool_calls`` are
  written back in that format and a ``tool`` turn's result as a user turn in
  ``<tool_response>`` tags. ``tool_choice: "none"`` leaves the tools out.
- **required / a named function.** The output is constrained (structured output) to JSON: one
  call object ``{"name", "arguments"}`` whose arguments follow the function's parameter schema
  (``parallel_tool_calls``: an array of at least one), so every call is valid by construction.
- **auto.** The model writes freely and a parser reads its answer (``--tool-call-parser``):
  ``hermes`` takes each ``<tool_call>{json}</tool_call>`` block (the text around them is the
  content); ``json`` takes an answer that is a whole call object, or an array of them.

:class:`ToolCallReader` does the reading as the text streams, on the gRPC and HTTP paths alike:
text goes out as content up to where a call may begin, and the calls come with the last chunk. A
resumed stream's reader first takes the text the client already had, so it holds back and parses
exactly as the interrupted one did. Call ids are derived from the request's id and the call's
index, so every gateway that serves the same stream names the same call the same way.

Pure: no I/O, tested without a server.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.structured_output import StructuredOutput

PARSERS = ("hermes", "json")
DEFAULT_PARSER = "hermes"
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
OPEN_TAG = "<tool_call>"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A body's tools and how they may be used. ``choice``: ``auto``, ``required`` or ``function``
    (``name`` then says which); ``none`` never gets here (the call is plain chat)."""

    tools: tuple[Tool, ...]
    choice: str
    name: str = ""
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tools(body: dict) -> ToolChoice | None:
    """The body's ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when no tool may be
    called (no tools, or ``tool_choice: "none"``)."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgumentError("parallel_tool_calls", "must be a boolean")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise InvalidArgumentError("tool_choice", "needs tools to choose from")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise InvalidArgumentError("tools", f"must be a list of at most {MAX_TOOLS} tools")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise InvalidArgumentError("tools", f"two tools are named {duplicate!r}")
    if choice is None or choice == "auto":
        return ToolChoice(tools, "auto", parallel=parallel is not False)
    if choice == "none":
        return None
    if choice == "required":
        return ToolChoice(tools, "required", parallel=parallel is not False)
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in names:
            raise InvalidArgumentError("tool_choice.function.name", f"must name one of the tools ({', '.join(names)}), "
                                                                    f"got {name!r}")
        return ToolChoice(tools, "function", name=name, parallel=False)
    raise InvalidArgumentError("tool_choice", 'must be "none", "auto", "required" or '
                                              '{"type": "function", "function": {"name": ...}}')


def _tool(i: int, raw: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise InvalidArgumentError(f"{where}.type", 'must be "function"')
    function = raw.get("function")
    if not isinstance(function, dict):
        raise InvalidArgumentError(f"{where}.function", "required: an object with name and parameters")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgumentError(f"{where}.function.name", "required: 1-64 letters, digits, '_', '.' or '-'")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidArgumentError(f"{where}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise InvalidArgumentError(f"{where}.function.parameters", "must be a JSON Schema object")
    return Tool(name, description, parameters)


# -- the prompt --------------------------------------------------------------------------------------

def system_turn(tools: ToolChoice) -> dict[str, str]:
    """The system turn that describes the tools and the answer format."""
    lines = [json.dumps({"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.parameters}}, ensure_ascii=False)
             for t in tools.tools]
    return {"role": "system", "content": (
        "You can call functions to help answer. The functions, as JSON schemas:\n<tools>\n" + "\n".join(lines)
        + "\n</tools>\nTo call one, answer with a JSON object naming it and giving its arguments, inside "
          "tags:\n<tool_call>\n{\"name\": \"function name\", \"arguments\": {\"argument\": \"value\"}}\n</tool_call>")}


def tool_call_text(name: str, arguments: Any) -> str:
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def assistant_text(index: int, content: str, tool_calls: Any) -> str:
    """An assistant turn that called tools, as the model would have written it."""
    if not isinstance(tool_calls, list):
        raise InvalidArgumentError(f"messages[{index}].tool_calls", "must be a list")
    parts = [content] if content else []
    for k, call in enumerate(tool_calls):
        where = f"messages[{index}].tool_calls[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidArgumentError(f"{where}.function", "required: an object with name and arguments")
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidArgumentError(f"{where}.function.arguments", "must be JSON text") from None
        parts.append(tool_call_text(function["name"], arguments))
    return "\n".join(parts)


def tool_result_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def render_turn(index: int, role: str, content: str, tool_calls: Any = None) -> dict[str, str]:
    """A turn as chat templates take it: a ``tool`` turn (a result) as a user turn in
    ``<tool_response>`` tags, an assistant turn's ``tool_calls`` written after its text as the
    model writes calls; other turns as they are."""
    if role == "tool":
        return {"role": "user", "content": tool_result_text(content)}
    if role == "assistant" and tool_calls:
        return {"role": "assistant", "content": assistant_text(index, content, tool_calls)}
    return {"role": role, "content": content}


def with_tools(messages: list[dict[str, str]], tools: ToolChoice) -> list[dict[str, str]]:
    """The conversation with the tools described first (in its own system turn, joined to one the
    conversation starts with: templates take one system turn, first)."""
    described = system_turn(tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{"role": "system", "content": first + "\n\n" + described["content"] if first else described["content"]},
                *messages[1:]]
    return [described, *messages]


# -- constrained calls -------------------------------------------------------------------------------

def constraint(tools: ToolChoice) -> StructuredOutput | None:
    """For ``required`` and a named function, the JSON every answer must be (None for ``auto``)."""
    if not tools.constrained:
        return None
    chosen = [t for t in tools.tools if tools.choice == "required" or t.name == tools.name]
    calls = [{"type": "object", "properties": {"name": {"enum": [t.name]}, "arguments": t.parameters},
              "required": ["name", "arguments"]} for t in chosen]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "minItems": 1, "items": one} if tools.parallel else one
    return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


# -- reading the answer ------------------------------------------------------------------------------

def call_id(request_id: str, k: int) -> str:
    """The id of request ``request_id``'s ``k``-th tool call (the same on every gateway)."""
    return "call_" + hashlib.sha256(f"{request_id}/{k}".encode()).hexdigest()[:24]


def _as_call(obj: Any, names: set[str]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object, or None when ``obj`` is not one."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


@dataclass(slots=True)
class ParsedAnswer:
    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments JSON)


def parse_answer(text: str, tools: ToolChoice, parser: str = DEFAULT_PARSER) -> ParsedAnswer:
    """A finished answer as content and tool calls. A constrained answer is JSON by construction
    (one that ran out of tokens is returned as content); an ``auto`` one is read by ``parser``.
    Anything that does not parse as a call of one of the tools stays content."""
    names = {t.name for t in tools.tools}
    if tools.constrained or parser == "json":
        try:
            value = json.loads(text)
        except ValueError:
            return ParsedAnswer(text)
        items = value if isinstance(value, list) else [value]
        calls = [_as_call(item, names) for item in items]
        if not calls or None in calls:
            return ParsedAnswer(text)
        return ParsedAnswer(None, calls)
    calls, rest, last = [], [], 0
    for match in _BLOCK.finditer(text):
        try:
            call = _as_call(json.loads(match.group(1)), names)
        except ValueError:
            call = None
        if call is None:
            continue
        rest.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    rest.append(text[last:])
    # trimmed where a call follows (held_back never lets a stream send that whitespace)
    content = (rest[0].rstrip() + "".join(rest[1:])).rstrip() if calls else text
    return ParsedAnswer(content or None, calls)


def held_back(text: str, tools: ToolChoice, parser: str = DEFAULT_PARSER) -> int:
    """Where a streamed answer's text must stop being sent as content: a constrained or ``json``
    answer is all held (it may be calls); a ``hermes`` one from its first ``<tool_call>``, or from
    a tail that could still become one, and the whitespace before it (trimmed from content when a
    call follows)."""
    if tools.constrained or parser == "json":
        return 0
    cut = text.find(OPEN_TAG)
    if cut < 0:
        cut = next((len(text) - k for k in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1)
                    if OPEN_TAG.startswith(text[-k:])), len(text))
    return len(text[:cut].rstrip())


class ToolCallReader:
    """One answer's text read for tool calls as it streams. :meth:`read` takes each new piece of
    text and returns the content to send now (what cannot be part of a call); :meth:`finish`
    returns the rest of the content and the calls. A finished answer that did not end as ``stop``
    (cut off at max_tokens, aborted) is content, all of it. ``skip``: text the client already had
    (a resumed stream), taken without being sent again."""

    def __init__(self, tools: ToolChoice, request_id: str, parser: str = DEFAULT_PARSER) -> None:
        self._tools = tools
        self._request_id = request_id
        self._parser = parser
        self._text = ""
        self._sent = 0  # characters of the text sent as content

    def skip(self, text: str) -> None:
        self._text += text
        self._sent = max(self._sent, held_back(self._text, self._tools, self._parser))

    def read(self, text: str) -> str:
        if not text:
            return ""
        self._text += text
        cut = held_back(self._text, self._tools, self._parser)
        fresh, self._sent = self._text[self._sent:cut], max(self._sent, cut)
        return fresh

    def finish(self, text: str, *, stopped: bool) -> tuple[str, list[ToolCall]]:
        self._text += text
        answer = parse_answer(self._text, self._tools, self._parser) if stopped else ParsedAnswer(self._text)
        calls = [ToolCall(call_id(self._request_id, k), name, arguments)
                 for k, (name, arguments) in enumerate(answer.calls)]
        # what was sent is where the content starts (parse_answer keeps the text before a call whole)
        return (answer.content or "")[self._sent:], calls
