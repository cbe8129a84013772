"""Scheduler behaviour, each test a story: build, schedule → hand-made model output → update, assert."""

from __future__ import annotations

import random

import pytest

from scheduler_service.core import (
    FinishReason,
    InvalidArgumentError,
    ModelRunnerOutput,
    RequestStatus,
    SamplingParams,
)
from scheduler_service.core.waiting_queue import MAX_PASSED_OVER
from servicekit.contract.prompt import check_prompt

from .helpers import EOS, make_request, make_scheduler, model_output, step


def run_to_completion(scheduler, token_fn=None, max_steps=1000):
    """Step until nothing is left; returns {request id: (all its output tokens, finish reason)}.

    Checks on the way that output indices are contiguous: no token is delivered twice or skipped.
    """
    token_fn = token_fn or (lambda rid: 1000 + scheduler.requests[rid].num_output_tokens)
    delivered = {rid: list(r.output_token_ids) for rid, r in scheduler.requests.items()}
    reasons: dict[str, FinishReason] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return {rid: (delivered[rid], reasons.get(rid)) for rid in delivered}
        out, results = step(scheduler, token_fn)
        assert out.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        for rid, o in results.items():
            got = delivered.setdefault(rid, [])
            req = scheduler.get_request(rid)
            if req is not None:  # still live: its own view agrees
                assert o.first_index + len(o.new_token_ids) == req.num_output_tokens
            if o.first_index > len(got):
                raise AssertionError(f"{rid}: index gap")
            assert o.first_index == len(got), f"{rid}: index {o.first_index} delivered twice"
            got.extend(o.new_token_ids)
            if o.finished:
                reasons[rid] = o.finish_reason
    raise AssertionError("did not finish")


def test_prefill_and_decode_mix_in_one_batch():
    s = make_scheduler()
    a = make_request(10, max_tokens=5)
    s.add_request(a)
    out, results = step(s)
    assert out.num_scheduled_tokens == {a.request_id: 10}
    assert [n.request_id for n in out.scheduled_new_reqs] == [a.request_id]
    assert len(out.scheduled_new_reqs[0].block_ids) == 3  # 10 tokens in 4-token blocks
    assert results[a.request_id].new_token_ids == [100] and results[a.request_id].first_index == 0

    b = make_request(7)
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 7}
    assert out.total_num_scheduled_tokens == 8
    cached = out.scheduled_cached_reqs
    assert (cached.req_ids, cached.num_computed_tokens, cached.new_block_ids) == ([a.request_id], [10], [[]])
    assert [n.request_id for n in out.scheduled_new_reqs] == [b.request_id]
    sampled = model_output(s, out, {a.request_id: 7, b.request_id: 8})
    results = {o.request_id: o for o in s.update_from_output(out, sampled)}
    assert results[a.request_id].new_token_ids == [7] and results[a.request_id].first_index == 1
    assert results[b.request_id].new_token_ids == [8] and results[b.request_id].first_index == 0
    assert a.num_computed_tokens == 11 and a.output_token_ids == [100, 7]


def test_long_prompt_is_chunked_over_several_steps_under_the_budget():
    s = make_scheduler(max_num_batched_tokens=16)
    decode = make_request(3, max_tokens=50)
    s.add_request(decode)
    step(s)  # decode is now decoding
    long = make_request(40)
    s.add_request(long)
    chunks = []
    for _ in range(4):
        out, results = step(s)
        assert out.num_scheduled_tokens[decode.request_id] == 1  # decodes keep going meanwhile
        chunks.append(out.num_scheduled_tokens[long.request_id])
        sampled = long.request_id in results
        assert sampled == (long.num_output_tokens == 1)
        if sampled:
            break
        assert long.num_computed_tokens == sum(chunks)  # a partial chunk samples nothing
    assert chunks == [15, 15, 10]
    assert long.output_token_ids == [100]


def test_long_prefill_threshold_caps_each_chunk():
    s = make_scheduler(long_prefill_token_threshold=12)
    r = make_request(40)
    s.add_request(r)
    chunks, new_blocks = [], []
    while not r.output_token_ids:
        out, _ = step(s)
        chunks.append(out.num_scheduled_tokens[r.request_id])
        new_blocks.append(len(out.scheduled_new_reqs[0].block_ids) if out.scheduled_new_reqs
                          else len(out.scheduled_cached_reqs.new_block_ids[0]))
    assert chunks == [12, 12, 12, 4]
    assert new_blocks == [3, 3, 3, 1]  # block tables grow with the chunks


def test_preemption_when_blocks_run_out_and_the_victim_later_finishes_with_the_right_tokens():
    s = make_scheduler(num_blocks=5)  # 4 usable blocks = 16 tokens
    a = make_request(6, max_tokens=8)
    b = make_request(6, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    token_fn = lambda rid: 1000 + s.requests[rid].num_output_tokens  # noqa: E731 - output i is 1000 + i
    for _ in range(3):  # prefill 6, then decode positions 6 and 7: 2 blocks each, the pool is full
        step(s, token_fn)
    out = s.schedule()  # a needs a 3rd block: b (the last admitted) is preempted
    assert out.preempted_req_ids == {b.request_id}
    assert out.num_scheduled_tokens == {a.request_id: 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting.peek() is b and s.stats().num_preemptions == 1
    s.update_from_output(out, model_output(s, out, token_fn))

    finished = run_to_completion(s, token_fn)
    assert finished[a.request_id] == ([1000 + i for i in range(8)], FinishReason.LENGTH)
    assert finished[b.request_id] == ([1000 + i for i in range(8)], FinishReason.LENGTH)
    assert b.num_preemptions == 1
    assert s.kv_cache_manager.get_num_free_blocks() == 4


def test_preempted_request_resumes_as_a_new_request_with_its_outputs():
    s = make_scheduler(num_blocks=5)
    a, b = make_request(6, max_tokens=8), make_request(6, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    for _ in range(4):
        step(s)
    assert b.status == RequestStatus.PREEMPTED
    resumed = None
    while resumed is None:
        out, _ = step(s)
        resumed = next((n for n in out.scheduled_new_reqs if n.request_id == b.request_id), None)
    assert resumed.prompt_token_ids == b.prompt_token_ids
    assert resumed.output_token_ids == [100, 100, 100]
    assert out.num_scheduled_tokens[b.request_id] == 9 - resumed.num_computed_tokens


def test_preempted_requests_return_to_the_front_in_their_order():
    s = make_scheduler(policy="fcfs", num_blocks=5)  # 4 usable blocks
    reqs = [make_request(4, max_tokens=4) for _ in range(4)]  # 1 block each: the pool is full
    for r in reqs:
        s.add_request(r)
    late = make_request(2, max_tokens=2)
    s.add_request(late)
    step(s)
    out = s.schedule()  # each needs a 2nd block: the last two give theirs to the first two
    assert out.preempted_req_ids == {reqs[2].request_id, reqs[3].request_id}
    assert list(out.num_scheduled_tokens) == [reqs[0].request_id, reqs[1].request_id]
    assert list(s.waiting) == [reqs[2], reqs[3], late]


def test_priority_policy_admits_by_priority_then_arrival():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    low, high, mid, mid_later = (make_request(4, priority=p, max_tokens=1) for p in (2, 0, 1, 1))
    for r in (low, high, mid, mid_later):
        s.add_request(r)
    order = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        order.extend(out.num_scheduled_tokens)
    assert order == [high.request_id, mid.request_id, mid_later.request_id, low.request_id]


def test_spf_policy_admits_the_fewest_prompt_tokens_first_and_fcfs_arrival_order():
    """A burst of prompts of mixed lengths: spf fills the step with the short ones (more first tokens
    from the step), fcfs takes arrival order; the cached prefix counts as computed."""
    lengths = (40, 8, 24, 12, 4)
    admitted = {}
    for policy in ("fcfs", "spf"):
        s = make_scheduler(policy=policy, max_num_batched_tokens=48, shared_prefill_token_threshold=0)
        burst = [make_request(n, max_tokens=1, request_id=f"len{n}") for n in lengths]
        for r in burst:
            s.add_request(r)
        out = s.schedule()
        admitted[policy] = out.num_scheduled_tokens
        run_to_completion(s)
        s.kv_cache_manager.block_pool.check_invariants()
    assert admitted["fcfs"] == {"len40": 40, "len8": 8}
    assert admitted["spf"] == {"len4": 4, "len8": 8, "len12": 12, "len24": 24}
    # A long prompt whose prefix the cache holds is cheap: it goes before a shorter cold one.
    s = make_scheduler(policy="spf", max_num_batched_tokens=16, shared_prefill_token_threshold=0)
    system = make_request(33, max_tokens=1, request_id="system")
    s.add_request(system)
    run_to_completion(s)
    cold = make_request(12, max_tokens=1, request_id="cold")
    warm = make_request(prompt_token_ids=list(system.prompt_token_ids[:32]) + [11, 12], max_tokens=1,
                        request_id="warm")  # 8 cached blocks, 2 tokens left
    s.add_request(cold)
    s.add_request(warm)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["warm", "cold"] and out.num_scheduled_tokens["warm"] == 2


def test_spf_policy_admits_a_long_prompt_after_at_most_max_passed_over_steps():
    """A long prompt behind a stream of short later arrivals that fill every step's budget goes
    first once it has been passed over MAX_PASSED_OVER times: no starvation."""
    s = make_scheduler(policy="spf", max_num_batched_tokens=8, shared_prefill_token_threshold=0, max_num_seqs=256)
    s.add_request(make_request(24, max_tokens=1, request_id="long"))
    for step_index in range(20):
        for _ in range(4):  # four 2-token later arrivals a step: a full budget
            s.add_request(make_request(2, max_tokens=1))
        out, _ = step(s)
        if "long" in out.num_scheduled_tokens:
            break
    else:
        raise AssertionError("the long prompt was never admitted")
    assert step_index == MAX_PASSED_OVER
    assert list(out.num_scheduled_tokens) == ["long"]  # first in the step, its chunk takes the budget
    run_to_completion(s)
    s.kv_cache_manager.block_pool.check_invariants()


def test_spf_policy_puts_requests_that_produced_tokens_before_shorter_newcomers():
    """Preempted (and resumed) requests are not overtaken by shorter newcomers: their streams have
    started, and a preempted one gets its blocks back before new prompts take them."""
    s = make_scheduler(policy="spf", num_blocks=5)  # 4 usable blocks
    reqs = [make_request(4, max_tokens=4) for _ in range(4)]  # 1 block each: the pool is full
    for r in reqs:
        s.add_request(r)
    step(s)
    out, _ = step(s)  # each needs a 2nd block: the last two give theirs to the first two
    assert out.preempted_req_ids == {reqs[2].request_id, reqs[3].request_id}
    newcomer = make_request(1, max_tokens=2)
    resumed = make_request(6, max_tokens=4, output_token_ids=[100])  # after a fault, one token delivered
    s.add_request(newcomer)
    s.add_request(resumed)
    s.waiting.reorder(s._admission_cost)
    assert list(s.waiting) == [reqs[2], reqs[3], resumed, newcomer]
    assert sorted(run_to_completion(s)) == sorted(r.request_id for r in (*reqs, newcomer, resumed))


def test_priority_policy_preempts_the_lowest_priority_running_request():
    s = make_scheduler(policy="priority", num_blocks=7)
    urgent, background, normal = (make_request(8, priority=p, max_tokens=8) for p in (0, 5, 1))
    for r in (urgent, background, normal):
        s.add_request(r)
    step(s)
    out = s.schedule()
    assert background.request_id in out.preempted_req_ids
    assert background.request_id not in out.num_scheduled_tokens
    assert set(out.num_scheduled_tokens) <= {urgent.request_id, normal.request_id}
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())


def test_priority_preemption_takes_back_a_victim_already_scheduled_this_step():
    s = make_scheduler(policy="priority", num_blocks=7)  # 6 usable blocks
    background = make_request(6, priority=5, max_tokens=8)  # room left in its 2nd block
    urgent, normal = make_request(8, priority=0, max_tokens=8), make_request(8, priority=1, max_tokens=8)
    for r in (background, urgent, normal):
        s.add_request(r)
    step(s)
    out = s.schedule()  # background fits and is scheduled, then urgent needs a block: background goes
    assert out.preempted_req_ids == {background.request_id}
    assert out.num_scheduled_tokens == {urgent.request_id: 1, normal.request_id: 1}
    assert out.scheduled_cached_reqs.req_ids == [urgent.request_id, normal.request_id]
    assert len(out.scheduled_cached_reqs.new_block_ids) == len(out.scheduled_cached_reqs.num_computed_tokens) == 2
    assert out.total_num_scheduled_tokens == 2 and s.running == [urgent, normal]


def test_a_waiting_request_without_blocks_is_not_overtaken():
    """In queue order (fcfs: arrival) the head waits for its blocks and nothing behind overtakes it."""
    s = make_scheduler(policy="fcfs", num_blocks=5)  # 4 usable blocks
    s.add_request(make_request(8, max_tokens=8))
    big, small = make_request(12, max_tokens=4), make_request(2, max_tokens=2)
    s.add_request(big)
    s.add_request(small)
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == [s.running[0].request_id]  # big needs 3 blocks, 2 are free
    assert list(s.waiting) == [big, small]


def test_reset_prefix_cache_only_when_idle():
    s = make_scheduler()
    prompt = list(range(10, 19))
    s.add_request(make_request(prompt_token_ids=prompt, max_tokens=2))
    step(s)
    assert s.reset_prefix_cache() is False
    run_to_completion(s)
    assert s.reset_prefix_cache() is True
    again = make_request(prompt_token_ids=prompt, max_tokens=1)
    s.add_request(again)
    assert s.schedule().scheduled_new_reqs[0].num_computed_tokens == 0


def test_abort_frees_blocks_of_running_and_waiting_requests():
    s = make_scheduler(max_num_seqs=1)
    running, waiting = make_request(10), make_request(10)
    s.add_request(running)
    s.add_request(waiting)
    step(s)
    assert s.kv_cache_manager.get_num_free_blocks() == 64 - 3
    outputs = s.abort([running.request_id, waiting.request_id, "unknown"])
    assert [(o.request_id, o.finish_reason, o.first_index) for o in outputs] == [
        (running.request_id, FinishReason.ABORT, 1), (waiting.request_id, FinishReason.ABORT, 0)]
    assert s.kv_cache_manager.get_num_free_blocks() == 64
    assert s.num_running == 0 and s.num_waiting == 0 and not s.has_unfinished_requests()
    assert running.status == RequestStatus.FINISHED_ABORTED and running.is_finished
    out = s.schedule()
    assert out.finished_req_ids == {running.request_id, waiting.request_id} and out.is_empty
    assert s.schedule().finished_req_ids == set()  # reported once


def test_abort_between_schedule_and_update_drops_the_tokens():
    s = make_scheduler()
    a, b = make_request(5), make_request(5)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    mro = model_output(s, out)
    s.abort([a.request_id])
    results = s.update_from_output(out, mro)
    assert [o.request_id for o in results] == [b.request_id]
    assert a.output_token_ids == []
    assert s.kv_cache_manager.get_num_free_blocks() == 64 - 2
    assert s.schedule().finished_req_ids == {a.request_id}


def test_prefix_hit_leaves_the_last_prompt_token_to_compute():
    s = make_scheduler()
    prompt = list(range(10, 18))  # exactly 2 full blocks
    first = make_request(prompt_token_ids=prompt, max_tokens=1)
    s.add_request(first)
    run_to_completion(s)
    again = make_request(prompt_token_ids=prompt, max_tokens=1)
    longer = make_request(prompt_token_ids=prompt + [99], max_tokens=1)
    s.add_request(again)
    s.add_request(longer)
    out, results = step(s)
    new = {n.request_id: n for n in out.scheduled_new_reqs}
    assert new[again.request_id].num_computed_tokens == 4  # not 8: token 8 must be computed for logits
    assert out.num_scheduled_tokens[again.request_id] == 4
    assert new[longer.request_id].num_computed_tokens == 8
    assert out.num_scheduled_tokens[longer.request_id] == 1
    assert results[longer.request_id].num_cached_tokens == 8
    assert new[longer.request_id].block_ids[0] == new[again.request_id].block_ids[0]  # one shared block
    stats = s.stats()
    assert stats.prefix_cache_queries == 8 + 8 + 9 and stats.prefix_cache_hits == 12


def test_a_resumed_request_reports_no_cache_hit_of_its_own_recomputation():
    """A request resumed after delivered outputs (its worker or scheduler died) recomputes prompt +
    delivered tokens, which another worker may hold cached: that hit is not the client's (its usage
    already has the first run's figure; "cached_tokens" never exceeds the prompt)."""
    s = make_scheduler()
    prompt = list(range(10, 13))
    first = make_request(prompt_token_ids=prompt, max_tokens=6)
    s.add_request(first)
    outputs = []
    while s.has_unfinished_requests():
        outputs += step(s, tokens=lambda rid: 50 + len(outputs))[1].values()
    delivered = list(first.output_token_ids[:5])  # 3 + 5 tokens: 2 full blocks cached
    resumed = make_request(prompt_token_ids=prompt, max_tokens=6, output_token_ids=delivered)
    s.add_request(resumed)
    out, results = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4  # the cache served the recomputation...
    assert results[resumed.request_id].num_cached_tokens == 0  # ...not the client's prompt


def test_cache_salt_isolates_prefixes():
    s = make_scheduler()
    prompt = list(range(10, 19))
    s.add_request(make_request(prompt_token_ids=prompt, max_tokens=1, cache_salt="tenant-a"))
    run_to_completion(s)
    other = make_request(prompt_token_ids=prompt, max_tokens=1, cache_salt="tenant-b")
    same = make_request(prompt_token_ids=prompt, max_tokens=1, cache_salt="tenant-a")
    s.add_request(other)
    s.add_request(same)
    out = s.schedule()
    new = {n.request_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    assert new == {other.request_id: 0, same.request_id: 8}


def test_request_created_with_delivered_outputs_resumes_after_them():
    s = make_scheduler()
    r = make_request(6, max_tokens=5, output_token_ids=[50, 51, 52])
    s.add_request(r)
    out, results = step(s, 60)
    (new,) = out.scheduled_new_reqs
    assert new.output_token_ids == [50, 51, 52]
    assert out.num_scheduled_tokens[r.request_id] == 9  # recompute prompt + delivered outputs
    assert results[r.request_id].first_index == 3 and results[r.request_id].new_token_ids == [60]
    _, results = step(s, 61)
    assert results[r.request_id].first_index == 4
    assert results[r.request_id].finish_reason == FinishReason.LENGTH  # max_tokens counts delivered ones
    assert r.output_token_ids == [50, 51, 52, 60, 61]


@pytest.mark.parametrize(
    ("params", "tokens", "expected", "reason"),
    [
        (dict(), [7, EOS, 7], [7, EOS], FinishReason.STOP),
        (dict(min_tokens=3), [EOS, EOS, EOS, EOS], [EOS, EOS, EOS], FinishReason.STOP),
        (dict(ignore_eos=True), [EOS] * 6, [EOS] * 5, FinishReason.LENGTH),
        (dict(stop_token_ids=(42,)), [7, 42, 7], [7, 42], FinishReason.STOP),
        (dict(stop_token_ids=(42,), ignore_eos=True), [EOS, 42], [EOS, 42], FinishReason.STOP),
        (dict(stop_token_ids=(42,), min_tokens=2), [42, 42], [42, 42], FinishReason.STOP),
        (dict(), [7] * 6, [7] * 5, FinishReason.LENGTH),
        # a stop token as the last token max_tokens allows still reads as one (vLLM checks it first)
        (dict(stop_token_ids=(42,)), [7, 7, 7, 7, 42], [7, 7, 7, 7, 42], FinishReason.STOP),
        (dict(), [7, 7, 7, 7, EOS], [7, 7, 7, 7, EOS], FinishReason.STOP),
    ],
)
def test_stop_conditions(params, tokens, expected, reason):
    s = make_scheduler()
    r = make_request(4, max_tokens=5, **params)
    s.add_request(r)
    got, finish = [], None
    for token in tokens:
        _, results = step(s, token)
        got.extend(results[r.request_id].new_token_ids)
        finish = results[r.request_id].finish_reason
        if finish is not None:
            break
    assert (got, finish) == (expected, reason)
    assert not s.has_unfinished_requests() and s.kv_cache_manager.get_num_free_blocks() == 64
    assert r.status == {FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
                        FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH}[reason]


def test_several_tokens_in_one_step_stop_at_the_first_stop_token():
    s = make_scheduler()
    r = make_request(4, max_tokens=10, logprobs=0)
    s.add_request(r)
    out = s.schedule()
    results = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={r.request_id: [5, EOS, 6]}))
    assert results[0].new_token_ids == [5, EOS] and results[0].finish_reason == FinishReason.STOP


def test_model_max_length_stops_the_request():
    s = make_scheduler(max_model_len=12)
    r = make_request(8, max_tokens=4)
    s.add_request(r)
    result = run_to_completion(s)
    assert result[r.request_id] == ([1000, 1001, 1002, 1003], FinishReason.LENGTH)


def test_missing_sample_recomputes_the_last_token():
    s = make_scheduler()
    r = make_request(5)
    s.add_request(r)
    out = s.schedule()
    assert s.update_from_output(out, ModelRunnerOutput()) == []
    assert r.num_computed_tokens == 4
    out, results = step(s)
    assert out.num_scheduled_tokens == {r.request_id: 1} and results[r.request_id].first_index == 0


def test_without_chunking_a_prompt_that_does_not_fit_waits_for_the_next_step():
    s = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32,
                       long_prefill_token_threshold=8)
    a, b = make_request(20, max_tokens=4), make_request(20, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {a.request_id: 20}  # whole prompt (threshold off), b waits
    out, _ = step(s)
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 20}


def test_chunking_off_requires_a_budget_of_max_model_len():
    with pytest.raises(InvalidArgumentError) as e:
        make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=256)
    assert e.value.field == "max_num_batched_tokens"


def test_max_num_seqs_caps_the_running_batch():
    s = make_scheduler(max_num_seqs=2)
    reqs = [make_request(4, max_tokens=2) for _ in range(3)]
    for r in reqs:
        s.add_request(r)
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {reqs[0].request_id, reqs[1].request_id}
    assert s.num_running == 2 and s.num_waiting == 1
    out, _ = step(s)  # both finish in update: the third is admitted next step
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {reqs[2].request_id}
    assert out.finished_req_ids == {reqs[0].request_id, reqs[1].request_id}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(prompt_token_ids=[]), "prompt"),
        (dict(prompt_token_ids=[-1, 5]), "prompt"),
        (dict(prompt_token_ids=[10**6]), "prompt"),
        (dict(n_tokens=256, max_tokens=1), "prompt"),
        (dict(n_tokens=200, max_tokens=57), "max_tokens"),
    ],
)
def test_the_prompt_check_names_the_field_the_worker_refuses(kwargs, field):
    s = make_scheduler()
    request = make_request(**kwargs)
    with pytest.raises(InvalidArgumentError) as e:
        check_prompt(request.prompt_token_ids, request.max_tokens, max_model_len=s.max_model_len,
                     vocab_size=s.worker.vocab_size)
    assert e.value.field == field


def test_add_request_refuses_a_request_with_no_output_left():
    s = make_scheduler()
    with pytest.raises(InvalidArgumentError) as e:
        s.add_request(make_request(n_tokens=4, max_tokens=3, output_token_ids=[5, 6, 7]))
    assert e.value.field == "max_tokens"
    assert not s.has_unfinished_requests()


def test_add_request_rejects_a_request_bigger_than_the_kv_cache():
    s = make_scheduler(num_blocks=5)  # 16 tokens of KV
    with pytest.raises(InvalidArgumentError) as e:
        s.add_request(make_request(10, max_tokens=7))
    assert e.value.field == "max_tokens"


def test_duplicate_request_id_is_rejected():
    s = make_scheduler()
    s.add_request(make_request(4, request_id="x"))
    with pytest.raises(InvalidArgumentError) as e:
        s.add_request(make_request(4, request_id="x"))
    assert e.value.field == "request_id"


def test_seeds_come_from_the_injected_rng_only():
    def seeds(rng):
        s = make_scheduler(seed_rng=rng)
        reqs = [make_request(4), make_request(4, seed=7)]
        for r in reqs:
            s.add_request(r)
        return [r.sampling_params.seed for r in reqs]

    assert seeds(random.Random(1)) == seeds(random.Random(1))
    assert seeds(random.Random(1))[1] == 7
    assert seeds(None) == seeds(random.Random(0))
    assert seeds(random.Random(1))[0] != seeds(random.Random(2))[0]


def test_stats_snapshot():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request(10))
    s.add_request(make_request(10))
    step(s)
    st = s.stats()
    assert (st.num_running, st.num_waiting, st.num_free_blocks, st.num_total_blocks) == (1, 1, 61, 64)
    assert st.kv_cache_usage == pytest.approx(3 / 64)
    assert st.num_preemptions == 0 and st.prefix_cache_hit_rate == 0.0


def test_sampling_params_arrive_seeded_and_unchanged():
    s = make_scheduler()
    r = make_request(4, temperature=0.5, top_k=3)
    s.add_request(r)
    (new,) = s.schedule().scheduled_new_reqs
    assert new.sampling_params.seed is not None
    assert new.sampling_params == SamplingParams(max_tokens=16, temperature=0.5, top_k=3, seed=new.sampling_params.seed)


def test_count_prefix_hit_tokens_probes_without_changing_anything():
    s = make_scheduler()
    prompt = list(range(10, 23))
    s.add_request(make_request(prompt_token_ids=prompt, max_tokens=1))
    run_to_completion(s)
    probe = make_request(prompt_token_ids=prompt + [5], max_tokens=1)
    free = s.kv_cache_manager.get_num_free_blocks()
    assert s.count_prefix_hit_tokens(probe) == 12
    assert probe.hashing_block_size == 0 and s.kv_cache_manager.get_num_free_blocks() == free
    assert make_scheduler(enable_prefix_caching=False).count_prefix_hit_tokens(probe) == 0
