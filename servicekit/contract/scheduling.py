"""How batches are formed: the scheduling settings, declared once for every place that batches.

:class:`BatchLimits` is what a worker holds (rows of its persistent batch, tokens per step, the
attention a prefill chunk may cost) and what a scheduler batches within; :class:`SchedulingConfig`
adds the scheduler's policy. The in-process ``LLM``, ``pagedserve serve``, the scheduler service
and the worker all take these same fields, so their defaults cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from servicekit.contract.settings import check_settings, setting
from servicekit.contract.worker import WorkerDescription

POLICIES = ("fcfs", "priority", "fair", "lpm", "spf")
# A step's duration is what a newcomer waits before its first token (and what a decoding request waits
# for its next one), and a long prompt's chunk sets it. While other requests wait or run, a chunk of at
# most 512 tokens keeps the step short on a CPU worker and leaves the rest of the budget to their
# prompts; a prompt alone takes the whole budget (benchmarks/ttft_fairness.py measures both).
DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD = 512
# The area cap (prefill_chunk_attention_limit) never cuts a chunk below this many tokens (a very long
# context still moves on).
MIN_PREFILL_CHUNK_TOKENS = 16
WORKERS_LIMIT = -1  # prefill_chunk_attention_limit: what the worker states for its device


@dataclass(frozen=True, kw_only=True)
class BatchLimits:
    """The limits of one worker's batch. A worker allocates for them; a scheduler batches within the
    smaller of its own and the worker's (:meth:`SchedulingConfig.for_worker`)."""

    max_num_seqs: int = setting(128, minimum=1, help="running requests at most (rows of a worker's persistent "
                                                     "batch; a scheduler takes the smaller of its and the worker's)")
    max_num_batched_tokens: int = setting(2048, minimum=1, help="token budget of one step, prefill chunks and "
                                                                "decodes together (a scheduler takes the smaller of "
                                                                "its and the worker's)")
    # A chunk's attention grows with the context already cached, so a chunk is also capped by the key
    # positions its tokens attend in all (n * context + n * (n + 1) / 2): every step stays short whatever
    # the context. The right cap depends on the device, so each worker states its own
    # (WorkerDescription; servicekit.contract.worker says why a CPU's is 1048576).
    prefill_chunk_attention_limit: int = setting(
        WORKERS_LIMIT, minimum=-1,
        help="key positions one prefill chunk attends in all (tokens x context): a long prompt's later chunks "
             "shrink so a step stays short at any context; at least 16 tokens still go (-1: what the worker "
             "states for its device, 1048576 on a CPU, none on a GPU; 0: off)")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True, kw_only=True)
class SchedulingConfig(BatchLimits):
    """How one scheduler forms batches (vLLM's SchedulerConfig). Every field is range-checked at
    construction; a bad value raises ``InvalidArgumentError`` naming it."""

    long_prefill_token_threshold: int = setting(0, minimum=0, help="a prefill chunk has at most this many tokens "
                                                                   "(0: off)")
    shared_prefill_token_threshold: int = setting(
        DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD, minimum=0,
        help="cap of one prefill chunk while other requests wait or run, so one long prompt cannot hold every "
             "newcomer's first token (0: off)")
    enable_chunked_prefill: bool = setting(True, help="split long prompts over steps (off: a prompt is scheduled "
                                                      "whole or waits)")
    enable_prefix_caching: bool = setting(True, help="reuse KV blocks of shared prefixes")
    policy: str = setting("spf", choices=POLICIES, help="waiting-queue order: fcfs (arrival), priority (lower "
                                                         "value first, then arrival), fair (between tenants by "
                                                         "their share of tokens served, the virtual token counter; "
                                                         "within priority classes), lpm (the longest cached "
                                                         "prompt prefix first, then arrival) or spf (the fewest "
                                                         "prompt tokens left to compute first, then arrival: in a "
                                                         "burst more first tokens come from each step); under lpm "
                                                         "and spf a request passed over in 4 steps, or one that "
                                                         "has produced tokens (preempted, resumed), goes first")

    def for_worker(self, worker: WorkerDescription) -> SchedulingConfig:
        """These settings within what ``worker`` states: its batch and step limits are maxima (where
        stated), and ``-1`` for the attention cap means the worker's own."""
        limit = self.prefill_chunk_attention_limit
        return replace(
            self,
            max_num_seqs=min(self.max_num_seqs, worker.max_num_seqs or self.max_num_seqs),
            max_num_batched_tokens=min(self.max_num_batched_tokens,
                                       worker.max_num_batched_tokens or self.max_num_batched_tokens),
            prefill_chunk_attention_limit=worker.prefill_chunk_attention_limit if limit == WORKERS_LIMIT else limit)
