"""Scheduler settings: one frozen dataclass, validated at construction (STYLE.md habit 4)."""

from __future__ import annotations

from dataclasses import dataclass

from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.worker import CPU_PREFILL_CHUNK_ATTENTION_LIMIT

POLICIES = ("fcfs", "priority")
# A step's duration is what a newcomer waits before its first token (and what a decoding request waits
# for its next one), and a long prompt's chunk sets it. While other requests wait or run, a chunk of at
# most 512 tokens keeps the step short on a CPU worker and leaves the rest of the budget to their
# prompts; a prompt alone takes the whole budget (benchmarks/ttft_fairness.py measures both).
DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD = 512
# A chunk's attention grows with the context already cached, so a chunk is also capped by the key
# positions its tokens attend in all (n * context + n * (n + 1) / 2), alone or not: every step stays
# short whatever the context, and that is the longest a newcomer waits for a step to end. The right
# cap depends on the device: each worker states its own (WorkerDescription); this default is a CPU
# worker's (servicekit.contract.worker says why), what a scheduler without a worker's word uses.
DEFAULT_PREFILL_CHUNK_ATTENTION_LIMIT = CPU_PREFILL_CHUNK_ATTENTION_LIMIT
# The area cap never cuts a chunk below this many tokens (a very long context still moves on).
MIN_PREFILL_CHUNK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How one scheduler forms batches.

    Invariant (enforced in ``__post_init__``): every field is in range; a bad value raises
    :class:`InvalidArgumentError` naming the field.
    """

    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 128  # running requests at most
    long_prefill_token_threshold: int = 0  # a prefill chunk has at most this many tokens; 0 = off
    # While other requests wait or run, a prefill chunk has at most this many tokens (0 = off): one long
    # prompt cannot hold every newcomer's first token (time to first token stays fair).
    shared_prefill_token_threshold: int = DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD
    # A prefill chunk attends at most this many key positions summed over its tokens (0 = off); at
    # least MIN_PREFILL_CHUNK_TOKENS tokens still go.
    prefill_chunk_attention_limit: int = DEFAULT_PREFILL_CHUNK_ATTENTION_LIMIT
    enable_chunked_prefill: bool = True  # False: a prompt is scheduled whole or waits
    enable_prefix_caching: bool = True  # reuse KV blocks of identical prefixes
    policy: str = "fcfs"  # "fcfs" (arrival order) or "priority" (lower value first, then arrival)

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, minimum=0)
        _check_int("shared_prefill_token_threshold", self.shared_prefill_token_threshold, minimum=0)
        _check_int("prefill_chunk_attention_limit", self.prefill_chunk_attention_limit, minimum=0)
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(name, f"must be a bool, got {getattr(self, name)!r}")
        if self.policy not in POLICIES:
            raise InvalidArgumentError("policy", f"must be one of {POLICIES}, got {self.policy!r}")


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidArgumentError(name, f"must be >= {minimum}, got {value}")
