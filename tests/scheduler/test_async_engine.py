"""The engine loop with asynchronous scheduling, against a scripted worker: a decoding batch's next
step is sent before the answer to the one running, every token is still published once and in
order, and a worker lost with two steps in flight hands back exactly what was published."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from servicekit.contract.scheduling import SchedulingConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from servicekit.contract.sampling_params import SamplingParams
from scheduler_service.engine import StepTimeFit, WorkerEngine
from .test_engine_loop import INFO, ScriptedWorker, make_request
from .test_stream_interval import LosableWorker, RecordingQueue


def make_engine(queue, worker, *, async_scheduling: bool, on_lost=None) -> WorkerEngine:
    core = Scheduler(SchedulingConfig(max_num_seqs=8, max_num_batched_tokens=64), INFO)
    return WorkerEngine(worker, replace(INFO, worker_id="w", max_num_seqs=8, max_num_batched_tokens=64), core, queue,
                        max_queued=8, on_finished=lambda n, a: None, on_lost=on_lost,
                        async_scheduling=async_scheduling)


async def run_requests(async_scheduling: bool):
    queue, worker = RecordingQueue(), ScriptedWorker()
    engine = make_engine(queue, worker, async_scheduling=async_scheduling)
    task = asyncio.create_task(engine.run())
    for rid, max_tokens in (("a", 6), ("b", 10), ("c", 1)):
        engine.submit(make_request(rid, max_tokens=max_tokens), f"entry-{rid}")
    await asyncio.wait_for(engine.wait_idle(), 5)
    task.cancel()
    published = {rid: [(r.first_index, list(r.token_ids), r.finish_reason) for r in queue.of(rid)] for rid in "abc"}
    return published, queue.finished, worker, engine


@pytest.mark.asyncio
async def test_the_next_decode_step_is_sent_before_the_answer_and_nothing_changes():
    want, want_finished, lockstep_worker, _ = await run_requests(False)
    got, finished, worker, engine = await run_requests(True)
    assert got == want and sorted(finished) == sorted(want_finished)
    assert [t for _first, tokens, _f in got["b"] for t in tokens] == [7] * 10
    assert lockstep_worker.max_in_flight == 1 and worker.max_in_flight == 2
    assert engine.num_steps_ahead >= 5  # b decodes 9 tokens after its first; most steps went ahead
    assert engine.core.kv_cache_manager.get_num_free_blocks() == engine.core.kv_cache_manager.num_total_blocks


@pytest.mark.asyncio
async def test_a_worker_lost_with_two_steps_in_flight_hands_back_what_was_published():
    queue = RecordingQueue()
    handed = []
    worker = LosableWorker(fail_after_steps=4)
    engine = make_engine(queue, worker, async_scheduling=True, on_lost=lambda engine, requests: handed.extend(requests))
    task = asyncio.create_task(engine.run())
    engine.submit(make_request("a", max_tokens=50), "entry-a")
    await asyncio.wait_for(task, 5)
    (request, entry_id), = handed
    published = [t for r in queue.of("a") for t in r.token_ids]
    assert entry_id == "entry-a" and list(request.output_token_ids) == published == [7, 7, 7, 7]
    assert engine.num_steps_ahead >= 1


class TimedWorker(ScriptedWorker):
    """Each step takes ``step_s`` on the worker; ``started`` lists the steps in the order they began."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s
        self.started: list = []

    async def step(self, so):
        self.started.append(so)
        await asyncio.sleep(self.step_s)
        return await super().step(so)


@pytest.mark.asyncio
async def test_a_request_arriving_early_in_a_step_is_admitted_by_the_next_one():
    """The step after the one in flight is planned late in it (a fifth of its time left), so a
    request that arrives in the first part of a step is admitted right after it, as without
    pipelining, while a steady decoding batch still has its steps sent ahead."""
    queue, worker = RecordingQueue(), TimedWorker(0.05)
    engine = make_engine(queue, worker, async_scheduling=True)
    task = asyncio.create_task(engine.run())
    engine.submit(make_request("a", max_tokens=40), "entry-a")
    while engine.num_steps_ahead < 3:
        await asyncio.sleep(0.005)
    seen = len(worker.started)
    while len(worker.started) == seen:  # a step just began on the worker
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
    running_index = len(worker.started) - 1
    engine.submit(make_request("b", max_tokens=3), "entry-b")
    await asyncio.wait_for(engine.wait_idle(), 10)
    task.cancel()
    admitted = next(i for i, so in enumerate(worker.started) if any(r.request_id == "b" for r in so.scheduled_new_reqs))
    assert admitted == running_index + 1
    assert [t for r in queue.of("a") for t in r.token_ids] == [7] * 40


class TokenTimedWorker(TimedWorker):
    """A step takes ``step_s`` plus ``token_s`` per scheduled token: prefill steps run longer."""

    def __init__(self, step_s: float, token_s: float) -> None:
        super().__init__(step_s)
        self.token_s = token_s

    async def step(self, so):
        self.started.append(so)
        await asyncio.sleep(self.step_s + self.token_s * so.total_num_scheduled_tokens)
        return await ScriptedWorker.step(self, so)


@pytest.mark.asyncio
async def test_a_request_arriving_during_a_long_prefill_step_is_admitted_right_after_it():
    """A step with a prefill chunk runs longer than the decode steps before it: the plan of the
    step after it is timed by its tokens, not by the decode steps' time, so a request arriving in
    the middle of the prefill is not left behind a step planned before it came."""
    queue, worker = RecordingQueue(), TokenTimedWorker(0.01, 0.003)
    engine = make_engine(queue, worker, async_scheduling=True)
    task = asyncio.create_task(engine.run())
    # a prefill step first, so its time per token is known, then a decoding stream
    engine.submit(Request("warm", list(range(10, 60)), SamplingParams(max_tokens=2, seed=1, ignore_eos=True)), "e-warm")
    engine.submit(make_request("a", max_tokens=60), "entry-a")
    while engine.num_steps_ahead < 3:
        await asyncio.sleep(0.005)
    engine.submit(Request("long", list(range(60, 10, -1)), SamplingParams(max_tokens=2, seed=1, ignore_eos=True)),
                  "e-long")  # no prefix of "warm"'s: all 50 tokens computed
    while not any(r.request_id == "long" for so in worker.started for r in so.scheduled_new_reqs):
        await asyncio.sleep(0.001)
    prefill_index = len(worker.started) - 1  # the step computing "long"'s 50 prompt tokens: ~160 ms
    await asyncio.sleep(0.06)  # well before its end, far past a decode step's time (~13 ms)
    engine.submit(make_request("late", max_tokens=2), "entry-late")
    await asyncio.wait_for(engine.wait_idle(), 20)
    task.cancel()
    admitted = next(i for i, so in enumerate(worker.started)
                    if any(r.request_id == "late" for r in so.scheduled_new_reqs))
    assert admitted == prefill_index + 1


def test_a_decode_step_is_expected_from_the_tokens_it_computes():
    # recent steps: 10 ms plus 1 ms a token; a step of 20 tokens after steps of 40-60 is expected
    # to take ~30 ms, where their average (~60 ms) would plan it too late
    fit = StepTimeFit()
    assert fit.predict(20) is None
    for tokens in (60, 50, 55, 45, 40, 52, 48, 44):
        fit.add(tokens, 0.010 + 0.001 * tokens)
    assert fit.predict(20) == pytest.approx(0.030)
    same = StepTimeFit()
    for _ in range(8):
        same.add(64, 0.1)
    assert same.predict(32) is None  # one token count only: no slope, the average is used
