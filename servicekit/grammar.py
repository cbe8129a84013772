"""The grammar engine behind structured output: xgrammar, for every constraint kind.

Why xgrammar: it is what vLLM and SGLang use by default, it ships CPU wheels for our Python, it
compiles a JSON schema for a 49k vocabulary in tens of milliseconds, and it fills a request's
next-token bitmask in microseconds with a torch function to apply it on the CPU or a GPU
(llguidance, the other candidate, is as fast per token but would need our own torch glue).

- :func:`check_sampling` / :func:`grammar_of`: is a constraint valid (schema, regex, grammar)?
  Raises ``InvalidArgumentError`` naming the caller's field. Needs no tokenizer, so the gateway and
  ``pagedserve.LLM`` refuse a bad request before it is queued.
- :class:`GrammarCompiler`: a constraint compiled against a model's vocabulary, cached by its text;
  the worker builds one per model and one matcher per constrained request.

Every kind is generated the same way: JSON without free whitespace (``any_whitespace`` off, so
a small model cannot wander in spaces) and, for a schema, xgrammar's strict mode (no properties the
schema does not name, as OpenAI's ``strict: true``).
"""

from __future__ import annotations

import functools
import json
import re
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


def grammar_of(constraint: StructuredOutput, field: str = "structured_output") -> Any:
    """The ``xgrammar.Grammar`` of ``constraint``; ``InvalidArgumentError(field, ...)`` when the
    engine refuses it. Needs no tokenizer: what the gateway checks is what the worker compiles."""
    xgr = _xgrammar()
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind in ("json_schema", "json_object"):
            return xgr.Grammar.from_ebnf(json_grammar(spec or _ANY_OBJECT))
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        return xgr.Grammar.from_ebnf(choice_grammar(spec) if kind == "choice" else spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidArgumentError(field, f"invalid {kind.replace('_', ' ')}: {_message(e)}") from None


@functools.lru_cache(maxsize=_CHECKED_CACHE_SIZE)
def _checked(constraint: StructuredOutput) -> None:
    """``grammar_of`` once per constraint seen valid (an invalid one raises, and is not cached)."""
    grammar_of(constraint)


def check_sampling(constraint: StructuredOutput | None, *, max_bytes: int = MAX_SPEC_BYTES,
                   field: str = "structured_output") -> None:
    """A request's constraint (None: nothing to check) within ``max_bytes`` and valid; a constraint
    seen valid before is not parsed again."""
    if constraint is None:
        return
    if constraint.size > max_bytes:
        raise InvalidArgumentError(field, f"is {constraint.size} bytes; at most {max_bytes} "
                                          "(the gateway's --max-structured-output-bytes)")
    try:
        _checked(constraint)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(field, e.message) from None


class GrammarCompiler:
    """Constraints compiled for one model's vocabulary (thread-safe; compiled grammars cached by
    constraint, least recently used dropped past :data:`COMPILED_CACHE_SIZE`)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.compile = functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)(
            lambda constraint: compiler.compile_grammar(grammar_of(constraint)))
        self.compile.__doc__ = "The ``xgrammar.CompiledGrammar`` of a constraint (InvalidArgumentError when invalid)."

    def matcher(self, constraint: StructuredOutput) -> Any:
        """A fresh ``xgrammar.GrammarMatcher`` at the start of ``constraint``."""
        return _xgrammar().GrammarMatcher(self.compile(constraint))
