"""A long prompt shares steps fairly.

Two caps keep every step short, so a newcomer's first token (and a decoding request's next token)
never waits behind a long prefill for long:
- while another request waits or runs, a prefill chunk has at most ``shared_prefill_token_threshold``
  tokens and the newcomers are scheduled in the same step;
- always, a chunk attends at most ``prefill_chunk_attention_limit`` key positions in all
  (``m * context + m * (m + 1) / 2`` for ``m`` tokens after ``context`` cached ones), so a long
  prompt's later chunks shrink as its context grows (attention is the part of a step that grows).
"""

from __future__ import annotations

import pytest

from .helpers import make_prompt, make_request, make_scheduler, step
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.scheduling import (
    DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD,
    MIN_PREFILL_CHUNK_TOKENS,
    SchedulingConfig,
)
from servicekit.contract.worker import CPU_PREFILL_CHUNK_ATTENTION_LIMIT

# A worker with room for an 8,000-token prompt (like SmolLM2-135M's context), default batching.
LONG_WORKER = dict(max_model_len=8192, num_blocks=2200, block_size=16)
BUDGET = SchedulingConfig().max_num_batched_tokens
SHARED = DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD
LIMIT = CPU_PREFILL_CHUNK_ATTENTION_LIMIT  # what make_worker's CPU worker states


def attended(context: int, m: int) -> int:
    """Key positions ``m`` chunk tokens after ``context`` cached ones attend in all."""
    return m * context + m * (m + 1) // 2


def largest_chunk(context: int, limit: int = LIMIT) -> int:
    """The largest ``m`` within the attention limit, by counting (the test's own oracle)."""
    m = 0
    while attended(context, m + 1) <= limit:
        m += 1
    return m


def test_a_long_prompt_alone_takes_the_budget_within_the_attention_limit_and_its_chunks_shrink():
    s = make_scheduler(**LONG_WORKER)
    long = make_request(8000, max_tokens=4)
    s.add_request(long)
    chunks: list[tuple[int, int]] = []  # (context, tokens)
    while long.num_computed_tokens < 8000:
        context = long.num_computed_tokens
        out, _ = step(s)
        chunks.append((context, out.num_scheduled_tokens[long.request_id]))
    print(f"{len(chunks)} chunks: {chunks}")
    assert sum(n for _, n in chunks) == 8000
    for context, n in chunks[:-1]:  # each as large as the limit (and budget) allow, no larger
        assert n == min(BUDGET, max(largest_chunk(context), MIN_PREFILL_CHUNK_TOKENS))
        assert attended(context, n) <= LIMIT
    sizes = [n for _, n in chunks]
    assert sizes[0] < BUDGET  # 2,048 tokens from nothing would attend ~2.1M positions
    assert sizes == sorted(sizes, reverse=True)  # later chunks (more context) are smaller
    assert sizes[-2] < SHARED  # by 7,000 tokens of context a chunk is well under the shared cap


def test_a_long_prefill_leaves_the_budget_to_short_requests_that_wait():
    s = make_scheduler(**LONG_WORKER)
    long = make_request(8000, max_tokens=4)
    s.add_request(long)
    out, _ = step(s)
    first = out.num_scheduled_tokens[long.request_id]
    shorts = [make_request(4, max_tokens=4) for _ in range(3)]
    for r in shorts:
        s.add_request(r)
    out, results = step(s)
    print(f"with 3 short requests waiting: {out.num_scheduled_tokens}")
    assert out.num_scheduled_tokens[long.request_id] == min(SHARED, largest_chunk(first))
    assert all(out.num_scheduled_tokens[r.request_id] == 4 for r in shorts)  # whole prompts, this step
    assert all(results[r.request_id].new_token_ids for r in shorts)  # ... so their first token comes now
    assert long.request_id not in results  # the long prompt is still prefilling


def test_the_long_prefill_takes_more_again_once_alone():
    s = make_scheduler(**LONG_WORKER)
    long, short = make_request(8000, max_tokens=4), make_request(4, max_tokens=1)
    s.add_request(long)
    s.add_request(short)
    out, results = step(s)
    assert out.num_scheduled_tokens == {long.request_id: SHARED, short.request_id: 4}
    assert results[short.request_id].finished
    out, _ = step(s)
    assert out.num_scheduled_tokens == {long.request_id: largest_chunk(SHARED)}
    assert largest_chunk(SHARED) > SHARED


def test_requests_that_decode_share_the_step_too():
    """A decoding request waits for each step: a long prefill beside it takes the shared cap."""
    s = make_scheduler(**LONG_WORKER)
    decoding = make_request(4, max_tokens=50)
    s.add_request(decoding)
    step(s)  # its prompt: now it only decodes
    long = make_request(8000, max_tokens=4)
    s.add_request(long)

    out, _ = step(s)

    assert out.num_scheduled_tokens == {decoding.request_id: 1, long.request_id: SHARED}


def test_a_prefix_that_waiting_requests_share_is_prefilled_whole_once():
    """Cut at the shared cap, the first of eight prompts sharing a 1,024-token prefix would leave the
    other seven to compute the prefix's second half each; the cap spares the shared prefix, so they
    all hit it in the same step and compute only their own 64 tokens."""
    s = make_scheduler(**LONG_WORKER)
    prefix = make_prompt(1024, "system prompt")
    requests = [make_request(prompt_token_ids=prefix + make_prompt(64, i), max_tokens=4) for i in range(8)]
    for r in requests:
        s.add_request(r)
    first, rest = requests[0], requests[1:]

    out, _ = step(s)

    assert out.num_scheduled_tokens[first.request_id] == 1024  # the shared prefix, past the 512 cap
    assert all(out.num_scheduled_tokens[r.request_id] == 64 for r in rest)
    assert all(r.num_cached_tokens == 1024 for r in rest)
    out, _ = step(s)
    assert out.num_scheduled_tokens[first.request_id] == 64  # its own part: within the cap again


def test_the_cap_still_cuts_a_prompt_that_shares_nothing_with_those_that_wait():
    s = make_scheduler(**LONG_WORKER)
    long = make_request(1500, max_tokens=4)
    others = [make_request(prompt_token_ids=make_prompt(1024, "other") + make_prompt(8, i)) for i in range(2)]
    for r in (long, *others):
        s.add_request(r)

    out, _ = step(s)

    assert out.num_scheduled_tokens[long.request_id] == SHARED


def test_both_caps_can_be_turned_off_and_a_tighter_hard_cap_wins():
    off = make_scheduler(policy="fcfs", shared_prefill_token_threshold=0, prefill_chunk_attention_limit=0,
                         **LONG_WORKER)
    long, short = make_request(8000), make_request(4)
    off.add_request(long)
    off.add_request(short)
    out, _ = step(off)
    assert out.num_scheduled_tokens == {long.request_id: BUDGET}  # the old behaviour: the short one waits
    for _ in range(2):  # 2,048-token chunks at any context, up to 6,144 (the short one decodes beside)
        out, _ = step(off)
        assert out.num_scheduled_tokens[long.request_id] == BUDGET - len(out.num_scheduled_tokens) + 1

    capped = make_scheduler(long_prefill_token_threshold=100, **LONG_WORKER)
    long, short = make_request(8000), make_request(4)
    capped.add_request(long)
    capped.add_request(short)
    out, _ = step(capped)
    assert out.num_scheduled_tokens == {long.request_id: 100, short.request_id: 4}


def test_a_tiny_attention_limit_still_moves_a_chunk_of_the_minimum_size():
    s = make_scheduler(prefill_chunk_attention_limit=10, **LONG_WORKER)
    long = make_request(300, max_tokens=1)
    s.add_request(long)
    sizes = []
    while long.num_computed_tokens < 300:
        out, _ = step(s)
        sizes.append(out.num_scheduled_tokens[long.request_id])
    assert sizes[:-1] == [MIN_PREFILL_CHUNK_TOKENS] * (len(sizes) - 1)
    assert sum(sizes) == 300


def test_without_chunked_prefill_a_prompt_goes_whole():
    s = make_scheduler(enable_chunked_prefill=False, prefill_chunk_attention_limit=1000, max_model_len=2048,
                       num_blocks=400)
    r = make_request(1500, max_tokens=1)
    s.add_request(r)
    out, results = step(s)
    assert out.num_scheduled_tokens == {r.request_id: 1500}
    assert results[r.request_id].finished


def test_a_negative_attention_limit_is_refused_by_name():
    with pytest.raises(InvalidArgumentError, match="prefill_chunk_attention_limit"):
        SchedulingConfig(prefill_chunk_attention_limit=-2)


def test_a_scheduler_takes_each_workers_word_unless_told():
    """The attention cap depends on the device: -1 (the scheduler's default) takes what the worker
    states (a CPU's cap, or none from a GPU worker); a value given to the scheduler wins."""
    from scheduler_service.config import SchedulerConfig
    from servicekit.contract.worker import WorkerDescription

    def scheduler_config_for(settings, worker):
        return settings.scheduling.for_worker(worker)

    cpu = WorkerDescription("m", 100, 16, 4096, 1000, (2,), max_num_seqs=8, max_num_batched_tokens=512,
                            prefill_chunk_attention_limit=LIMIT)
    gpu = WorkerDescription("m", 100, 16, 4096, 1000, (2,), max_num_seqs=8, max_num_batched_tokens=512)
    default = SchedulerConfig()
    assert scheduler_config_for(default, cpu).prefill_chunk_attention_limit == LIMIT
    assert scheduler_config_for(default, gpu).prefill_chunk_attention_limit == 0
    told = SchedulerConfig(prefill_chunk_attention_limit=4096)
    assert scheduler_config_for(told, gpu).prefill_chunk_attention_limit == 4096
    off = SchedulerConfig(prefill_chunk_attention_limit=0)
    assert scheduler_config_for(off, cpu).prefill_chunk_attention_limit == 0
    config = scheduler_config_for(SchedulerConfig(max_num_seqs=99), cpu)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (8, 512)  # never more than the worker's
    with pytest.raises(ValueError, match="prefill_chunk_attention_limit"):
        SchedulerConfig(prefill_chunk_attention_limit=-2)
