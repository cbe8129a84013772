"""A long prompt shares steps fairly (issue 11, defect 10): alone it takes the whole token budget;
while short requests wait, its chunks shrink to the shared threshold and the newcomers are scheduled
in the same step, so their first token does not wait for the whole long prefill."""

from __future__ import annotations

from core.helpers import make_request, make_scheduler, step
from scheduler_service.core.config import DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD, SchedulerConfig

# A worker with room for an 8,000-token prompt (like SmolLM2-135M's context), default batching.
LONG_WORKER = dict(max_model_len=8192, num_blocks=2200, block_size=16)
BUDGET = SchedulerConfig().max_num_batched_tokens


def test_a_long_prefill_leaves_the_budget_to_short_requests_that_wait():
    s = make_scheduler(**LONG_WORKER)
    long = make_request(8000, max_tokens=4)
    s.add_request(long)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {long.request_id: BUDGET}  # alone: the whole budget, as before

    shorts = [make_request(4, max_tokens=4) for _ in range(3)]
    for r in shorts:
        s.add_request(r)
    out, results = step(s)
    print(f"with 3 short requests waiting: {out.num_scheduled_tokens}")
    assert out.num_scheduled_tokens[long.request_id] == DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD
    assert all(out.num_scheduled_tokens[r.request_id] == 4 for r in shorts)  # whole prompts, this step
    assert all(results[r.request_id].new_token_ids for r in shorts)  # ... so their first token comes now
    assert long.request_id not in results  # the long prompt is still prefilling


def test_the_long_prefill_takes_the_whole_budget_again_once_alone():
    s = make_scheduler(**LONG_WORKER)
    long, short = make_request(8000, max_tokens=4), make_request(4, max_tokens=1)
    s.add_request(long)
    s.add_request(short)
    out, results = step(s)
    assert out.num_scheduled_tokens == {long.request_id: DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD,
                                        short.request_id: 4}
    assert results[short.request_id].finished
    out, _ = step(s)
    assert out.num_scheduled_tokens == {long.request_id: BUDGET}


def test_the_shared_threshold_can_be_turned_off_and_a_tighter_hard_cap_wins():
    off = make_scheduler(shared_prefill_token_threshold=0, **LONG_WORKER)
    long, short = make_request(8000), make_request(4)
    off.add_request(long)
    off.add_request(short)
    out, _ = step(off)
    assert out.num_scheduled_tokens == {long.request_id: BUDGET}  # the old behaviour: the short one waits

    capped = make_scheduler(long_prefill_token_threshold=100, **LONG_WORKER)
    long, short = make_request(8000), make_request(4)
    capped.add_request(long)
    capped.add_request(short)
    out, _ = step(capped)
    assert out.num_scheduled_tokens == {long.request_id: 100, short.request_id: 4}


def test_requests_that_only_decode_leave_the_long_prefill_the_whole_budget():
    s = make_scheduler(**LONG_WORKER)
    decoding = make_request(4, max_tokens=50)
    s.add_request(decoding)
    step(s)  # its prompt: now it only decodes
    long = make_request(8000, max_tokens=4)
    s.add_request(long)

    out, _ = step(s)

    assert out.num_scheduled_tokens == {decoding.request_id: 1, long.request_id: BUDGET - 1}
