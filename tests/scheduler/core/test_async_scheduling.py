"""Asynchronous scheduling: ``Scheduler.schedule_continuation`` plans the step after one in flight,
before its results are in (vLLM's async scheduling). The worker runs steps in the order sent and
appends its own samples, so the plan holds exactly when it is the plan ``schedule()`` would make
after the results: decoding requests, one token each, nobody waiting for a seat.

The FakeWorker checks every diff against what it holds (computed counts, blocks, KV written per
position), so a plan built on a wrong assumption fails loudly here as a real worker would."""

from __future__ import annotations

import random
import zlib
from collections import deque
from dataclasses import replace

import pytest

from scheduler_service.core import FinishReason, ModelRunnerOutput

from .helpers import EOS, FakeWorker, make_request, make_scheduler, model_output
from .test_speculation import looping_model

SHARED_PREFIXES = [[11 + i for i in range(n)] for n in (0, 8, 13, 24)]


def decoding(s, *requests):
    """Add ``requests`` and run steps until every one has sampled its first token."""
    for r in requests:
        s.add_request(r)
    while any(r.num_output_tokens == 0 for r in requests):
        out = s.schedule()
        s.update_from_output(out, model_output(s, out))


def two_in_flight(a_max_tokens: int = 10, b_max_tokens: int = 10):
    """Two decoding requests, a step of theirs sent and the one after it planned:
    (scheduler, a, b, the step in flight, its continuation)."""
    s = make_scheduler()
    a, b = make_request(5, max_tokens=a_max_tokens), make_request(5, max_tokens=b_max_tokens)
    decoding(s, a, b)
    first = s.schedule()
    return s, a, b, first, s.schedule_continuation(first)


def test_the_next_decode_step_is_planned_while_one_runs():
    s = make_scheduler(block_size=4)
    a, b = make_request(6, max_tokens=10), make_request(3, max_tokens=10)
    decoding(s, a, b)
    first = s.schedule()
    assert first.num_scheduled_tokens == {a.request_id: 1, b.request_id: 1}
    second = s.schedule_continuation(first)
    assert second.num_scheduled_tokens == {a.request_id: 1, b.request_id: 1}
    assert second.total_num_scheduled_tokens == 2 and not second.scheduled_new_reqs
    # the worker is told the counts it will have once ``first`` ran
    cached = second.scheduled_cached_reqs
    assert dict(zip(cached.req_ids, cached.num_computed_tokens)) == {
        a.request_id: a.num_computed_tokens + 1, b.request_id: b.num_computed_tokens + 1}
    # a: 6 prompt + 1 output = 7 tokens in 2 blocks; its continuation computes position 7 (still block 2)
    # b: 3 + 1 = 4 tokens fill one block; position 4 needs a second block
    blocks = dict(zip(cached.req_ids, cached.new_block_ids))
    assert blocks[a.request_id] == [] and len(blocks[b.request_id]) == 1
    out1 = s.update_from_output(first, model_output(s, first, 40))
    out2 = s.update_from_output(second, model_output(s, second, 41))
    assert [(o.first_index, o.new_token_ids) for o in out1] == [(1, [40]), (1, [40])]
    assert [(o.first_index, o.new_token_ids) for o in out2] == [(2, [41]), (2, [41])]
    assert a.num_computed_tokens == 8 and a.output_token_ids == [100, 40, 41]


def test_a_request_whose_token_in_flight_is_its_last_is_left_out():
    s, a, b, first, second = two_in_flight(a_max_tokens=2)
    assert set(second.num_scheduled_tokens) == {b.request_id}
    results = {o.request_id: o for o in s.update_from_output(first, model_output(s, first))}
    assert results[a.request_id].finish_reason == FinishReason.LENGTH


def drafted_near_its_end():
    """a (5 outputs at most) has 2 outputs and 2 drafts in flight, b goes on: (scheduler, a, b, the
    step in flight, its continuation)."""
    s = make_scheduler()
    a, b = make_request(5, max_tokens=5, ignore_eos=True), make_request(5, max_tokens=20, ignore_eos=True)
    decoding(s, a, b)
    s.update_from_output(s.schedule(), ModelRunnerOutput(sampled_token_ids={a.request_id: [7], b.request_id: [7]},
                                                         spec_token_ids={a.request_id: [5, 6, 7]}))
    first = s.schedule()
    assert first.scheduled_spec_decode_tokens == {a.request_id: [5, 6]}  # within max_tokens
    return s, a, b, first, s.schedule_continuation(first)


def test_one_whose_drafts_in_flight_may_end_it_decodes_on():
    # its drafts rejected, a goes on in the plan made while they were in flight: no lockstep step
    s, a, b, first, second = drafted_near_its_end()
    assert set(second.num_scheduled_tokens) == {a.request_id, b.request_id}
    s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={a.request_id: [9], b.request_id: [9]}))
    out = {o.request_id: o for o in s.update_from_output(second, model_output(s, second, 12))}
    assert out[a.request_id].new_token_ids == [12] and a.output_token_ids == [100, 7, 9, 12]
    # a holds slots up to its last token (5 prompt + 5 outputs) and no further
    bs = s.kv_cache_manager.block_size
    assert len(s.kv_cache_manager.req_to_blocks[a.request_id]) == -(-(5 + 5) // bs)


def test_one_whose_drafts_in_flight_ended_it_is_dropped_from_the_plan_made_before():
    # both drafts accepted: a has its 5 tokens after ``first`` and is finished, its blocks (the
    # plan's too) free; the worker skips it in ``second`` (it knows a has all of its max_tokens),
    # and the next plan tells the worker a is finished
    s, a, b, first, second = drafted_near_its_end()
    kv = s.kv_cache_manager
    ended = {o.request_id: o for o in s.update_from_output(
        first, ModelRunnerOutput(sampled_token_ids={a.request_id: [5, 6, 8], b.request_id: [9]}))}
    assert ended[a.request_id].finish_reason == FinishReason.LENGTH and a.output_token_ids == [100, 7, 5, 6, 8]
    assert a.request_id not in kv.req_to_blocks
    kv.block_pool.check_invariants()
    worker_answer = ModelRunnerOutput(sampled_token_ids={b.request_id: [10]})  # a skipped
    assert [o.request_id for o in s.update_from_output(second, worker_answer)] == [b.request_id]
    third = s.schedule()
    assert a.request_id in third.finished_req_ids and a.request_id not in third.num_scheduled_tokens


def test_a_continuation_counts_the_drafts_its_worker_will_compute():
    # a's last answer brought a proposal of 3 drafts: the continuation computes a's token and up to
    # num_own_drafts of them; b has none
    s, a, b, first, second = two_in_flight(a_max_tokens=20, b_max_tokens=20)
    assert s.num_tokens_computed(first) == first.total_num_scheduled_tokens == 2
    s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={a.request_id: [7], b.request_id: [7]},
                                                  spec_token_ids={a.request_id: [5, 6, 7]}))
    assert second.continuation and second.num_own_drafts == 0
    assert s.num_tokens_computed(second) == 2  # drafts not allowed in this plan
    assert s.num_tokens_computed(replace(second, num_own_drafts=2)) == 2 + 2
    assert s.num_tokens_computed(replace(second, num_own_drafts=4)) == 2 + 3


def test_no_plan_while_the_results_decide_it():
    # a partial prefill chunk: its next chunk is schedule()'s to size
    s = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    s.add_request(make_request(30))
    assert s.schedule_continuation(s.schedule()) is None
    # a request waits and a seat is free: it is admitted by schedule(), with the results in
    s = make_scheduler(max_num_seqs=4)
    a = make_request(5)
    decoding(s, a)
    first = s.schedule()
    s.add_request(make_request(5))
    assert s.schedule_continuation(first) is None
    # every seat taken: the waiting one could not run anyway, the batch goes on
    s = make_scheduler(max_num_seqs=1)
    a = make_request(5)
    decoding(s, a)
    s.add_request(make_request(5))
    assert s.schedule_continuation(s.schedule()).num_scheduled_tokens == {a.request_id: 1}
    # nothing running, or everyone's token in flight is the last
    s = make_scheduler()
    assert s.schedule_continuation(s.schedule()) is None
    a = make_request(5, max_tokens=2)
    decoding(s, a)
    assert s.schedule_continuation(s.schedule()) is None


def test_memory_short_means_no_plan_and_nothing_lost():
    # 4 usable blocks of 4 tokens; a and b (7 prompt tokens + 1 output each) fill two blocks each
    # in the step in flight, so the continuation (position 8) needs blocks nobody has
    s = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)
    a, b = make_request(7, max_tokens=8, ignore_eos=True), make_request(7, max_tokens=8, ignore_eos=True)
    decoding(s, a, b)
    first = s.schedule()
    assert len(first.num_scheduled_tokens) == 2 and s.kv_cache_manager.get_num_free_blocks() == 0
    assert s.schedule_continuation(first) is None
    s.update_from_output(first, model_output(s, first))
    while s.has_unfinished_requests():  # schedule() preempts as usual; everything still finishes
        out = s.schedule()
        s.update_from_output(out, model_output(s, out))
        s.kv_cache_manager.block_pool.check_invariants()
    assert s.num_preemptions and a.num_output_tokens == b.num_output_tokens == 8
    assert s.kv_cache_manager.get_num_free_blocks() == 4


def test_a_stop_in_flight_drops_the_extra_token_and_frees_everything():
    s, a, b, first, second = two_in_flight()
    out1 = {o.request_id: o for o in s.update_from_output(first, model_output(s, first, {a.request_id: EOS}))}
    assert out1[a.request_id].finish_reason == FinishReason.STOP
    assert a.request_id not in s.requests  # its blocks are free, its continuation still runs on the worker
    worker_samples = ModelRunnerOutput(sampled_token_ids={a.request_id: [50], b.request_id: [50]})
    out2 = s.update_from_output(second, worker_samples)
    assert [o.request_id for o in out2] == [b.request_id]  # a's extra token is dropped
    third = s.schedule()
    assert a.request_id in third.finished_req_ids and a.request_id not in third.num_scheduled_tokens


def test_an_abort_while_two_steps_are_in_flight():
    s, a, b, first, second = two_in_flight()
    s.update_from_output(first, model_output(s, first))
    [aborted] = s.abort([a.request_id])
    assert aborted.finish_reason == FinishReason.ABORT
    third = s.schedule_continuation(second)  # planned after the abort: a is gone, its id goes out
    assert set(third.num_scheduled_tokens) == {b.request_id} and a.request_id in third.finished_req_ids
    worker_samples = ModelRunnerOutput(sampled_token_ids={a.request_id: [50], b.request_id: [50]})
    assert [o.request_id for o in s.update_from_output(second, worker_samples)] == [b.request_id]


def token_fn(request_id: str, index: int) -> int:
    """The fake model: a pure function of (request, output index); EOS about one time in 40."""
    value = zlib.crc32(f"{request_id}/{index}".encode()) % 40
    return EOS if value == 0 else 10 + value


def expected_tokens(rid: str, max_tokens: int, ignore_eos: bool, min_tokens: int = 0) -> list[int]:
    tokens = []
    for i in range(max_tokens):
        tokens.append(token_fn(rid, i))
        if tokens[-1] == EOS and not ignore_eos and len(tokens) >= min_tokens:
            break
    return tokens


def simulate(num_requests: int, seed: int, *, pipelined: bool, abort_rate: float = 0.0, burst: bool = False,
             tenants: int = 0, num_drafts: int = 0, workers: list | None = None, model=None, **config):
    """Random arrivals and aborts between steps; with ``pipelined`` the step after each one in
    flight is planned before its results (as the engine loop does), and the worker runs what it was
    sent in order. Returns (delivered tokens by id, finish reasons by id, steps, steps planned ahead,
    the scheduler); the FakeWorker is appended to ``workers`` when given. ``model``: the fake model
    (default ``token_fn``)."""
    rng = random.Random(seed)
    s = make_scheduler(seed_rng=random.Random(seed), **config)
    worker = FakeWorker(s.worker.num_blocks, s.worker.block_size, model or token_fn, check_every=1,
                        num_drafts=num_drafts)
    if workers is not None:
        workers.append(worker)
    arrivals: dict[int, list] = {}
    for k in range(num_requests):
        prompt = rng.choice(SHARED_PREFIXES) + [rng.randrange(10, 60) for _ in range(rng.randint(1, 40))]
        max_tokens = rng.randint(1, 32)
        request = make_request(request_id=f"sim-{seed}-{k}", prompt_token_ids=prompt, max_tokens=max_tokens,
                               ignore_eos=rng.random() < 0.3, min_tokens=min(max_tokens, rng.choice((0, 0, 3))),
                               arrival_time=float(k))
        if tenants:
            request.tenant = f"t{rng.randrange(tenants)}"
        arrivals.setdefault(0 if burst else rng.randrange(num_requests), []).append(request)
    delivered: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    in_flight: deque = deque()
    steps = ahead = tick = 0
    while len(finish) < num_requests:
        for request in arrivals.pop(tick, []):
            s.add_request(request)
        if abort_rate and s.running and rng.random() < abort_rate:
            for o in s.abort([rng.choice(s.running).request_id]):
                finish[o.request_id] = o.finish_reason
        tick += 1
        if not in_flight:
            out = s.schedule()
            if out.is_empty:
                continue
            in_flight.append(out)
        if pipelined:
            following = s.schedule_continuation(in_flight[0])
            if following is not None:
                in_flight.append(following)
                ahead += 1
        out = in_flight.popleft()
        steps += 1
        for o in s.update_from_output(out, worker.execute(out)):
            got = delivered.setdefault(o.request_id, [])
            assert o.request_id not in finish, "an output after the finish"
            assert o.first_index == len(got), "an output index was skipped or repeated"
            got.extend(o.new_token_ids)
            if o.finished:
                finish[o.request_id] = o.finish_reason
        assert steps < 100 * num_requests, "no progress"
    while in_flight:  # the last continuation: every request in it finished meanwhile
        out = in_flight.popleft()
        assert s.update_from_output(out, worker.execute(out)) == []
    kv = s.kv_cache_manager
    assert not s.has_unfinished_requests()
    assert kv.get_num_free_blocks() == kv.num_total_blocks and kv.req_to_blocks == {}
    kv.block_pool.check_invariants()
    return delivered, finish, steps, ahead, s


@pytest.mark.parametrize("config", [
    dict(num_blocks=81, block_size=4, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=24),
    dict(num_blocks=41, block_size=4, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=24,
         policy="priority", long_prefill_token_threshold=16),
    dict(num_blocks=400, block_size=16, max_model_len=128, max_num_batched_tokens=256, max_num_seqs=8),
    dict(num_blocks=81, block_size=4, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8,
         policy="fair", tenants=3),
])
def test_pipelined_steps_deliver_what_lockstep_steps_deliver(config):
    """Same requests, arrivals and model: every request ends with the same tokens and finish
    reason as in lockstep, every KV position the worker reads holds the token it should (preemption,
    prefix hits, stop tokens in flight included), and the pool ends empty."""
    sync, sync_finish, sync_steps, _, _ = simulate(400, 5, pipelined=False, **config)
    got, got_finish, steps, ahead, s = simulate(400, 5, pipelined=True, **config)
    assert got == sync and got_finish == sync_finish
    for rid, tokens in got.items():  # the model's tokens, up to each finish
        assert tokens == [token_fn(rid, i) for i in range(len(tokens))]
    assert ahead > 0  # arrivals all along: steps whose successor waits for an admission are not
    print(f"{steps} steps ({sync_steps} in lockstep), {ahead} planned ahead, "
          f"{s.num_preemptions} preemptions, prefix hits {s.kv_cache_manager.prefix_cache_hits} tokens")


@pytest.mark.parametrize("num_drafts", [0, 3])
def test_a_burst_decodes_almost_every_step_ahead(num_drafts):
    """All requests at once and seats for all (the served benchmark's shape): once the prompts are
    in, each step's successor is sent while it runs, with draft tokens too (one whose drafts in
    flight may end it decodes on; the worker skips it if they did)."""
    config = dict(num_blocks=600, block_size=16, max_model_len=256, max_num_batched_tokens=512, max_num_seqs=64)
    model = looping_model if num_drafts else None  # drafts mostly right, some ending their request
    sync, sync_finish, sync_steps, _, _ = simulate(64, 3, pipelined=False, burst=True, num_drafts=num_drafts,
                                                   model=model, **config)
    workers: list = []
    got, finish, steps, ahead, _ = simulate(64, 3, pipelined=True, burst=True, num_drafts=num_drafts,
                                            workers=workers, model=model, **config)
    assert got == sync and finish == sync_finish and steps == sync_steps
    assert ahead >= steps * 0.8, (ahead, steps)
    assert (workers[0].num_skipped > 0) == (num_drafts > 0)


@pytest.mark.parametrize("config", [
    dict(num_blocks=81, block_size=4, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=24),
    dict(num_blocks=41, block_size=4, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=24,
         policy="priority", long_prefill_token_threshold=16),
    dict(num_blocks=600, block_size=16, max_model_len=256, max_num_batched_tokens=512, max_num_seqs=64, burst=True),
])
def test_pipelined_steps_with_drafts_deliver_what_lockstep_steps_deliver(config):
    """Draft tokens (the fake worker proposes by prompt lookup, as the real one) in steps planned
    ahead: a continuation lets the worker verify its own drafts after its last token as it holds
    it, and the tokens are still the model's, as in lockstep; the KV it reads is what it should be."""
    sync, sync_finish, sync_steps, _, _ = simulate(300, 9, pipelined=False, num_drafts=3, **config)
    got, got_finish, steps, ahead, s = simulate(300, 9, pipelined=True, num_drafts=3, **config)
    assert got == sync and got_finish == sync_finish
    for rid, tokens in got.items():
        assert tokens == [token_fn(rid, i) for i in range(len(tokens))]
    assert ahead > (steps * 0.5 if config.get("burst") else 0), (ahead, steps)
    assert s.own_draft_limit == 3
    print(f"{steps} steps ({sync_steps} in lockstep), {ahead} planned ahead")


def test_pipelined_steps_with_aborts_between_them():
    got, finish, steps, ahead, _ = simulate(300, 11, pipelined=True, abort_rate=0.2, num_blocks=61, block_size=4,
                                            max_model_len=128, max_num_batched_tokens=64, max_num_seqs=16)
    assert sum(f == FinishReason.ABORT for f in finish.values()) > 10 and ahead > 0
    for rid, tokens in got.items():
        assert tokens == [token_fn(rid, i) for i in range(len(tokens))]
