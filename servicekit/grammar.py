"""The grammar engine behind structured output: xgrammar, for every constraint kind.

Why xgrammar: it is what vLLM and SGLang use by default, it ships CPU wheels for our Python, it
compiles a JSON schema for a 49k vocabulary in tens of milliseconds, and it fills a request's
next-token bitmask in microseconds with a torch function to apply it on the CPU or a GPU
(llguidance, the other candidate, is as fast per token but would need our own torch glue).

- :func:`check`: is a constraint valid (schema, regex, grammar)? Raises ``InvalidArgumentError``
  naming the caller's field. Needs no tokenizer, so the gateway and ``pagedserve.LLM`` refuse a bad
  request before it is queued.
- :class:`GrammarCompiler`: a constraint compiled against a model's vocabulary, cached by its text;
  the worker builds one per model and one matcher per constrained request.

Every kind is generated the same way: JSON without free whitespace (``any_whitespace`` off, so
a small model cannot wander in spaces) and, for a schema, xgrammar's strict mode (no properties the
schema does not name, as OpenAI's ``strict: true``).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.structured_output import StructuredOutput

_JSON_OPTIONS = {"any_whitespace": False, "strict_mode": True}
_ANY_OBJECT = '{"type":"object"}'
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: "
_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
COMPILED_CACHE_SIZE = 256  # compiled grammars a worker keeps (a schema's is tens to hundreds of KB)
MAX_SPEC_BYTES = 64 << 10  # the default bound on a constraint's text (a schema, regex, grammar, choices)
CHECK_TIMEOUT_S = 5.0  # the default bound on checking one (the gateway's --structured-output-check-s)
_CHECKED_CACHE_SIZE = 1024


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # installed with the project; say what is missing rather than fail later
        raise InvalidArgumentError("structured_output", f"the grammar engine is not installed here ({e}): "
                                                        "pip install xgrammar") from None
    return xgrammar


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a quoted literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar 0.2.9 writes a string with minLength / maxLength as a repetition of this class, which
# lets control characters (U+0000-U+001F) through: JSON forbids them raw in a string (json.loads
# refuses the output). The class is rewritten to exclude them, as its unbounded strings already do.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def json_grammar(schema: str) -> str:
    """The EBNF grammar of a JSON schema as this engine generates it (see _LOOSE_STRING_CHAR)."""
    text = str(_xgrammar().Grammar.from_json_schema(schema, **_JSON_OPTIONS))
    return text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


def _message(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return _LOCATION.sub("", text[0] if text else type(exc).__name__)


def check(constraint: StructuredOutput, field: str = "structured_output") -> None:
    """Raise ``InvalidArgumentError(field, ...)`` unless the engine accepts ``constraint``."""
    xgr = _xgrammar()
    try:
        if constraint.kind == "json_schema":
            xgr.Grammar.from_json_schema(constraint.spec, **_JSON_OPTIONS)
        elif constraint.kind == "regex":
            xgr.Grammar.from_regex(constraint.spec)
        elif constraint.kind == "grammar":
            xgr.Grammar.from_ebnf(constraint.spec)
        elif constraint.kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(constraint.spec))
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidArgumentError(field, f"invalid {constraint.kind.replace('_', ' ')}: {_message(e)}") from None


_checked: OrderedDict[tuple, None] = OrderedDict()  # constraints already found valid (by text)
_checked_lock = threading.Lock()


def check_sampling(constraint: StructuredOutput | None, *, max_bytes: int = MAX_SPEC_BYTES,
                   field: str = "structured_output") -> None:
    """A request's constraint (None: nothing to check) within ``max_bytes`` and valid; a constraint
    seen valid before is not parsed again."""
    if constraint is None:
        return
    if constraint.size > max_bytes:
        raise InvalidArgumentError(field, f"is {constraint.size} bytes; at most {max_bytes} "
                                          "(the gateway's --max-structured-output-bytes)")
    with _checked_lock:
        if constraint.key in _checked:
            _checked.move_to_end(constraint.key)
            return
    check(constraint, field)
    with _checked_lock:
        _checked[constraint.key] = None
        while len(_checked) > _CHECKED_CACHE_SIZE:
            _checked.popitem(last=False)


class GrammarCompiler:
    """Constraints compiled for one model's vocabulary (thread-safe; compiled grammars cached by
    text, least recently used dropped past :data:`COMPILED_CACHE_SIZE`)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: StructuredOutput) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``constraint`` (InvalidArgumentError when invalid)."""
        key = constraint.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = self._compile(constraint)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidArgumentError("structured_output",
                                       f"invalid {constraint.kind.replace('_', ' ')}: {_message(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > COMPILED_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, constraint: StructuredOutput) -> Any:
        c = self._compiler
        if constraint.kind in ("json_schema", "json_object"):
            return c.compile_grammar(json_grammar(constraint.spec or _ANY_OBJECT))
        if constraint.kind == "regex":
            return c.compile_regex(constraint.spec)
        if constraint.kind == "choice":
            return c.compile_grammar(choice_grammar(constraint.spec))
        return c.compile_grammar(constraint.spec)

    def matcher(self, constraint: StructuredOutput) -> Any:
        """A fresh ``xgrammar.GrammarMatcher`` at the start of ``constraint``."""
        return _xgrammar().GrammarMatcher(self.compile(constraint))
