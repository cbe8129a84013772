"""A worker whose step fails while the scheduler plans the step after it (asynchronous scheduling),
over real gRPC: however the failure meets the next write (the call already ended, or not yet), the
engine treats the worker as lost and hands its requests back with exactly the tokens it published;
it never fails them as if the scheduler were broken."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import pytest

from servicekit.contract.scheduling import SchedulingConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine import WorkerEngine
from scheduler_service.worker_client import connect
from servicekit.contract.step import ModelRunnerOutput, SchedulerOutput
from .test_engine_loop import make_request
from .test_stream_interval import RecordingQueue
from worker.test_worker_reset import INFO
from worker_service.grpc_server import WorkerServicer, build_server
from worker_service.simulated_runner import SimulatedRunner

pytestmark = [pytest.mark.service, pytest.mark.asyncio]


class FailingRunner(SimulatedRunner):
    """Fails at the start of its ``fail_at``-th non-empty step, as a CUDA error or a broken plan would."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(INFO, step_latency=(0.002, 0.0))
        self.fail_at = fail_at
        self.steps = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.total_num_scheduled_tokens:
            self.steps += 1
            if self.steps == self.fail_at:
                raise RuntimeError("the step failed on the worker")
        return super().execute_model(scheduler_output)


@contextlib.asynccontextmanager
async def failing_worker(fail_at: int):
    """A worker gRPC server whose runner fails at step ``fail_at``, and a scheduler's client of it:
    (client, its description)."""
    servicer = WorkerServicer(FailingRunner(fail_at), worker_id="w", max_num_seqs=8, max_num_batched_tokens=64)
    server = build_server(servicer)
    port = server.bind("127.0.0.1:0")
    await server.start()
    client = None
    try:
        client, description = await connect(f"127.0.0.1:{port}")
        yield client, description
    finally:
        if client is not None:
            await client.close()
        servicer.stopping = True
        await server.drain(0.5)
        servicer.close()


@pytest.mark.parametrize("fail_at", [2, 3, 4, 5, 6, 7])
async def test_a_failed_step_under_a_planned_one_hands_the_requests_back(fail_at):
    async with failing_worker(fail_at) as (client, description):
        core = Scheduler(SchedulingConfig(max_num_seqs=8, max_num_batched_tokens=64), description)
        queue, handed = RecordingQueue(), []
        engine = WorkerEngine(client, replace(description, worker_id="w"), core, queue, max_queued=8,
                              on_finished=lambda n, a: None, on_lost=lambda e, requests: handed.extend(requests),
                              async_scheduling=True)
        for rid in ("a", "b"):
            engine.submit(make_request(rid, max_tokens=40), f"entry-{rid}")
        await asyncio.wait_for(engine.run(), 10)  # returns after the hand-back
        assert sorted(entry for _request, entry in handed) == ["entry-a", "entry-b"]
        for request, _entry in handed:
            published = [t for r in queue.of(request.request_id) for t in r.token_ids]
            assert list(request.output_token_ids) == published and len(published) == fail_at - 1
            assert not any(r.error_message for r in queue.of(request.request_id))
        # A step is planned ahead once a decode step's time is known (after step 2), during a step
        # still running: with fail_at 3 that is the failing step, whose answer may come first.
        assert engine.num_steps_ahead >= 1 or fail_at <= 3


async def test_a_write_after_the_worker_ended_the_stream_is_a_lost_worker():
    """The race above made certain: the step in flight fails, the call ends, then the planned step
    is written (grpc raises InvalidStateError there, which is not a scheduler bug)."""
    from scheduler_service.worker_client import WorkerLostError

    async with failing_worker(1) as (client, description):
        core = Scheduler(SchedulingConfig(max_num_seqs=8, max_num_batched_tokens=64), description)
        core.add_request(make_request("a", max_tokens=4))
        await client.send(core.schedule())  # fails on the worker at once
        for _ in range(100):
            if client._call.done():
                break
            await asyncio.sleep(0.01)
        with pytest.raises(WorkerLostError, match="Step stream ended: INTERNAL"):
            await client.send(SchedulerOutput())


class LoopBlockingRunner(SimulatedRunner):
    """Its first non-empty step holds the worker's event loop for ``hold_s`` just as it ends (as a
    long answer being sent would); the times the loop was freed and each later step started."""

    def __init__(self, loop: asyncio.AbstractEventLoop, hold_s: float) -> None:
        super().__init__(INFO, step_latency=(0.0, 0.0))
        self.loop, self.hold_s = loop, hold_s
        self.starts: list[float] = []
        self.loop_freed = 0.0

    def _hold_loop(self) -> None:
        time.sleep(self.hold_s)
        self.loop_freed = time.perf_counter()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.total_num_scheduled_tokens:
            self.starts.append(time.perf_counter())
            if len(self.starts) == 1:
                time.sleep(0.3)  # the step planned after it arrives meanwhile
                self.loop.call_soon_threadsafe(self._hold_loop)
        return super().execute_model(scheduler_output)


async def test_a_step_sent_ahead_starts_when_the_one_before_ends_not_when_the_event_loop_is_free():
    """With asynchronous scheduling the next step reaches the worker while one runs: it goes to the
    runner thread at once and starts the moment the step before it ends, however long the event loop
    then takes to send that step's answer (a busy loop used to sit between every two steps)."""
    runner = LoopBlockingRunner(asyncio.get_running_loop(), hold_s=0.5)
    servicer = WorkerServicer(runner, worker_id="w", max_num_seqs=8, max_num_batched_tokens=64)
    server = build_server(servicer)
    port = server.bind("127.0.0.1:0")
    await server.start()
    client, description = await connect(f"127.0.0.1:{port}")
    try:
        core = Scheduler(SchedulingConfig(max_num_seqs=8, max_num_batched_tokens=64), description)
        core.add_request(make_request("a", max_tokens=8))
        first = core.schedule()
        await client.send(first)
        ahead = core.schedule_continuation(first)
        assert ahead is not None
        await client.send(ahead)
        assert (await client.receive()).sampled_token_ids and (await client.receive()).sampled_token_ids
        assert len(runner.starts) == 2
        assert runner.starts[1] < runner.loop_freed  # old behaviour: after it, 0.5 s later
    finally:
        await client.close()
        servicer.stopping = True
        await server.drain(0.5)
        servicer.close()


async def test_an_answer_whose_columns_do_not_add_up_is_a_lost_worker(monkeypatch):
    """A worker answering with more sampled tokens than requests (a broken or mismatched build) is
    lost, so its requests go elsewhere; the scheduler does not fail them as its own bug."""
    from scheduler_service.worker_client import WorkerLostError
    from servicekit.proto import step

    to_pb = step.runner_output_to_pb

    def corrupted(output, step_id, execute_seconds):
        msg = to_pb(output, step_id, execute_seconds)
        if msg.sampled.token_ids:  # steps that sampled (connect() runs an empty one first)
            msg.sampled.token_ids.append(7)
        return msg

    monkeypatch.setattr(step, "runner_output_to_pb", corrupted)
    async with failing_worker(0) as (client, description):
        core = Scheduler(SchedulingConfig(max_num_seqs=8, max_num_batched_tokens=64), description)
        core.add_request(make_request("a", max_tokens=4))
        await client.send(core.schedule())
        with pytest.raises(WorkerLostError, match="malformed answer to step .*: a step's answer names 1 requests and 2 tokens"):
            await client.receive()
