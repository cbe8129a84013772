"""Per-request sampling and stopping parameters (frozen, validated at construction)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields, replace

from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.structured_output import StructuredOutput, structured_output_of

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
# Every list a client sends is bounded, so one request cannot make another's steps slow or the worker
# big: stop token ids are a per-request set the worker keeps while min_tokens applies. Real stop
# lists hold a few ids (a chat template's end tokens); 128 leaves room for unusual vocabularies.
MAX_STOP_TOKEN_IDS = 128
SEED_RANGE = 2**63
MAX_LOGIT_BIAS_IDS = 300  # OpenAI's own bound
# allowed_token_ids: the worker masks every other id of the request's row each step (one pass over
# the vocabulary, only for rows that have the list); the bound keeps a request's record small.
MAX_ALLOWED_TOKEN_IDS = 16384
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100], as OpenAI's


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop it.

    Invariant (enforced in ``__post_init__``): every field is in range; a bad value raises
    :class:`InvalidArgumentError` naming the field. A temperature below ``GREEDY_BELOW`` (0 included)
    means greedy, as vLLM's ``_SAMPLING_EPS``: divided by less, float32 logits overflow.
    """

    max_tokens: int = 16  # output tokens to generate at most (>= 1)
    min_tokens: int = 0  # EOS / stop token ids are ignored before this many outputs
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = all tokens; otherwise >= 1
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    min_p: float = 0.0  # drop tokens with p < min_p * p_max, in [0, 1]
    seed: int | None = None  # None: one is assigned at admission (sampling stays reproducible)
    stop: tuple[str, ...] = ()  # stop strings, matched on text at the gateway
    stop_token_ids: tuple[int, ...] = ()  # stop when one is sampled (after min_tokens); <= MAX_STOP_TOKEN_IDS
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    repetition_penalty: float = 1.0  # > 0; 1 = off (HF semantics, over prompt + output)
    presence_penalty: float = 0.0  # in [-2, 2]; over output tokens (OpenAI semantics)
    frequency_penalty: float = 0.0  # in [-2, 2]; over output tokens
    logprobs: int | None = None  # top-n logprobs per sampled token (0..MAX_LOGPROBS), None = off
    # logprob of each prompt token after the first, plus top-n alternatives (vLLM's prompt_logprobs;
    # 0..MAX_LOGPROBS), None = off. Such a request computes its whole prompt (no prefix-cache hit).
    prompt_logprobs: int | None = None
    # (token id, bias) pairs added to the logits before sampling, ascending by id (a dict is taken too)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # sample only these ids (vLLM's allowed_token_ids), ascending and unique; () = every id
    allowed_token_ids: tuple[int, ...] = ()
    # what the output must spell: a StructuredOutput, or vLLM's form {"json": schema} / {"regex": ...} /
    # {"choice": [...]} / {"grammar": ...} / {"json_object": True}; None = free text
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Normalise list inputs to tuples so the object stays hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        allowed = _token_id_set("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
        object.__setattr__(self, "allowed_token_ids", allowed)
        object.__setattr__(self, "structured_output", structured_output_of(self.structured_output))
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidArgumentError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_float("temperature", self.temperature, lo=0.0)
        _check_int("top_k", self.top_k, minimum=-1)
        if self.top_k == 0:
            raise InvalidArgumentError("top_k", "must be -1 (disabled) or >= 1, got 0")
        _check_float("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0, maximum=SEED_RANGE - 1)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgumentError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidArgumentError("stop", "stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_LEN:
                raise InvalidArgumentError("stop", f"a stop string is longer than {MAX_STOP_STRING_LEN} characters")
        _check_token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError("ignore_eos", "must be a bool")
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0, maximum=MAX_LOGPROBS)
        if self.structured_output is not None:
            self._check_structured_output()

    def _check_structured_output(self) -> None:
        """A constrained request ends when its grammar does: settings that keep it going past the
        end, or that take away the tokens the grammar allows, conflict with it."""
        if not isinstance(self.structured_output, StructuredOutput):
            raise InvalidArgumentError("structured_output", "must be a StructuredOutput")
        conflicts = {"ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                     "allowed_token_ids": self.allowed_token_ids}
        for name, value in conflicts.items():
            if value:
                raise InvalidArgumentError(name, "cannot be combined with structured output (the grammar decides "
                                                 "which tokens may come and when the output ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def speculable(self) -> bool:
        """Whether draft tokens can be verified for this request in one step (servicekit.contract.step):
        its token at an output position depends only on the logits there and the position (seed,
        temperature and filters, bias, allowed ids), not on the outputs before it (penalties, a
        grammar), and it asks for no per-token logprobs. ``min_tokens`` bans depend on the position
        too: drafts come only once they are past (:meth:`max_drafts`)."""
        return (self.structured_output is None and self.logprobs is None and self.repetition_penalty == 1.0
                and not self.presence_penalty and not self.frequency_penalty)

    def max_drafts(self, num_outputs: int) -> int:
        """Draft tokens a request with ``num_outputs`` outputs may verify in its next step: none
        unless ``speculable`` and past ``min_tokens``; never more than the outputs left after the
        token that step samples anyway. The one rule: the worker proposes within it, the
        scheduler schedules within it."""
        if num_outputs < self.min_tokens or not self.speculable:
            return 0
        return max(0, self.max_tokens - num_outputs - 1)

    def with_seed(self, seed: int) -> SamplingParams:
        """A copy with ``seed`` set (validated like any field)."""
        return replace(self, seed=seed)

    def seeded(self, rng: random.Random) -> SamplingParams:
        """The one place a seed is assigned (docs/architecture.md, decision 6): ``self`` when it has one, else a
        copy with a seed drawn from ``rng`` (the gateway's at admission, the offline engine's)."""
        if self.seed is not None:
            return self
        return self.trusted(**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "seed"},
                            seed=rng.randrange(SEED_RANGE))

    @classmethod
    def trusted(cls, **values) -> SamplingParams:
        """An instance from values that were validated where they entered (a record decoded by an
        inner service): not checked again. Unnamed fields take their defaults."""
        params = object.__new__(cls)
        for f in fields(cls):
            object.__setattr__(params, f.name, values.pop(f.name) if f.name in values else f.default)
        if values:
            raise TypeError(f"unknown sampling parameters: {', '.join(sorted(values))}")
        return params


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """``{token_id: bias}`` or (id, bias) pairs as validated pairs in ascending id order."""
    try:
        pairs = list(value.items() if isinstance(value, dict) else value)
    except TypeError:
        raise InvalidArgumentError("logit_bias", "must map token ids to biases") from None
    if len(pairs) > MAX_LOGIT_BIAS_IDS:
        raise InvalidArgumentError("logit_bias", f"at most {MAX_LOGIT_BIAS_IDS} token ids, got {len(pairs)}")
    out = {}
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise InvalidArgumentError("logit_bias", "must map token ids to biases")
        token_id, bias = pair
        _check_int("logit_bias", token_id, minimum=0)
        _check_float("logit_bias", bias, lo=-LOGIT_BIAS_RANGE, hi=LOGIT_BIAS_RANGE)
        out[token_id] = float(bias)
    return tuple(sorted(out.items()))


def _token_id_set(name: str, value: object, limit: int) -> tuple[int, ...]:
    """Token ids as an ascending tuple without repeats (at most ``limit`` given)."""
    try:
        ids = list(value)
    except TypeError:
        raise InvalidArgumentError(name, "must be a list of token ids") from None
    _check_token_ids(name, ids, limit)
    return tuple(sorted(set(ids)))


def _check_token_ids(name: str, ids: tuple[int, ...] | list[int], limit: int) -> None:
    if len(ids) > limit:  # before the per-item loop: bound the work too
        raise InvalidArgumentError(name, f"at most {limit} ids, got {len(ids)}")
    for t in ids:
        _check_int(name, t, minimum=0)


GREEDY_BELOW = 1e-5  # temperatures below it sample greedily (the worker's sampler)
INT32_MAX = 2**31 - 1  # the wire's int32 counts and uint32 token ids hold every value up to it


def _check_int(name: str, value: object, *, minimum: int, maximum: int = INT32_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidArgumentError(name, f"must be >= {minimum}, got {value}")
    if value > maximum:
        raise InvalidArgumentError(name, f"must be <= {maximum}, got {value}")


def _check_float(name: str, value: object, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(name, f"must be a finite number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        bound = f"> {lo}" if lo_open else f">= {lo}"
        raise InvalidArgumentError(name, f"must be {bound}, got {value}")
    if hi is not None and value > hi:
        raise InvalidArgumentError(name, f"must be <= {hi}, got {value}")
