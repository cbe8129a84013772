"""A request's output constraint (structured output): what its tokens must spell.

Pure data, standard library only. The grammar engine (``servicekit.grammar``) compiles it where the
logits are (the worker) and checks it where a request enters (the gateway, ``pagedserve.LLM``); the
scheduler carries it unread. A constraint's state is a pure function of the request's output tokens,
so a request that moves (preemption, a worker's or scheduler's death, a resumed stream) rebuilds it
from the tokens it already delivered and continues inside the grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from servicekit.contract.errors import InvalidArgumentError

# What ``kind`` may be, and what ``spec`` then holds:
KINDS = {
    "json_schema": "a JSON Schema document, as JSON text (its properties generated in the given order)",
    "json_object": "any JSON object (spec is empty)",
    "regex": "a regular expression the whole output matches",
    "choice": "one of a list of strings (spec is the tuple of them)",
    "grammar": "an EBNF grammar (xgrammar's dialect, GBNF-like, with a `root` rule)",
}
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Invariant: ``kind`` is one of :data:`KINDS`; ``spec`` is a non-empty string (``json_object``:
    empty), or for ``choice`` a non-empty tuple of non-empty strings. Whether the text is a valid
    schema, regex or grammar is the grammar engine's to say (``servicekit.grammar.grammar_of``)."""

    kind: str
    spec: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError("structured_output", f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            spec = self.spec
            if isinstance(spec, str) or not isinstance(spec, (list, tuple)):
                raise InvalidArgumentError("structured_output", "choice takes a list of strings")
            object.__setattr__(self, "spec", tuple(spec))
            if not self.spec or len(self.spec) > MAX_CHOICES:
                raise InvalidArgumentError("structured_output", f"choice takes 1 to {MAX_CHOICES} strings, got {len(self.spec)}")
            if not all(isinstance(c, str) and c for c in self.spec):
                raise InvalidArgumentError("structured_output", "each choice must be a non-empty string")
        elif not isinstance(self.spec, str):
            raise InvalidArgumentError("structured_output", f"{self.kind} takes a string")
        elif self.kind == "json_object":
            if self.spec:
                raise InvalidArgumentError("structured_output", "json_object takes no spec")
        elif not self.spec:
            raise InvalidArgumentError("structured_output", f"{self.kind} must not be empty")

    @property
    def size(self) -> int:
        """The spec's size in bytes (UTF-8), which the gateway bounds."""
        parts = self.spec if isinstance(self.spec, tuple) else (self.spec,)
        return sum(len(p.encode()) for p in parts)


# vLLM's ``structured_outputs`` keys (and the SDK's one argument) → kinds
_KEYS = {"json": "json_schema", "json_schema": "json_schema", "json_object": "json_object", "regex": "regex",
         "choice": "choice", "grammar": "grammar"}


def schema_text(schema: object, field: str) -> str:
    """A JSON Schema (a dict, or JSON text) as compact JSON text, its key order kept."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidArgumentError(field, f"is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise InvalidArgumentError(field, "must be a JSON Schema object")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def structured_output_of(value: object, field: str = "structured_output") -> StructuredOutput | None:
    """A constraint from what a caller wrote: a :class:`StructuredOutput`, or a mapping with one of
    ``json`` (a schema: dict or JSON text), ``json_object`` (true), ``regex``, ``choice`` (a list of
    strings), ``grammar`` (vLLM's ``structured_outputs``). None for None or an empty mapping;
    errors name ``field`` and its key."""
    if value is None or isinstance(value, StructuredOutput):
        return value
    if not isinstance(value, dict):
        raise InvalidArgumentError(field, "must be an object with one of json, json_object, regex, choice, grammar")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = [k for k in given if k not in _KEYS]
    if unknown:
        raise InvalidArgumentError(f"{field}.{unknown[0]}", "is not a supported constraint "
                                                           f"(one of {', '.join(k for k in _KEYS if k != 'json_schema')})")
    if len(given) > 1:
        raise InvalidArgumentError(field, f"give one constraint, got {', '.join(given)}")
    if not given:
        return None
    key, spec = next(iter(given.items()))
    kind = _KEYS[key]
    try:
        if kind == "json_schema":
            return StructuredOutput(kind, schema_text(spec, f"{field}.{key}"))
        if kind == "json_object":
            if spec is not True:
                raise InvalidArgumentError(f"{field}.{key}", "must be true")
            return StructuredOutput(kind)
        return StructuredOutput(kind, spec)
    except InvalidArgumentError as e:
        if e.field != "structured_output":
            raise
        raise InvalidArgumentError(f"{field}.{key}", e.message) from None
