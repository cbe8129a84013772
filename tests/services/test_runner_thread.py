"""The worker runs every torch call on one thread, loading included.

Each thread that enters OpenMP gets a thread team of its own; a runner loaded on one thread and
stepped on another leaves two teams contending for the same cores (measured on 2 CPU cores: 1.65
cores busy instead of 1.99, the served stack 12 % slower than the in-process engine).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.services.test_worker_reset import INFO
from worker_service.config import ModelRunnerConfig
from worker_service.grpc_server import WorkerServicer
from worker_service.main import WorkerApp, WorkerSettings
from worker_service.simulated_runner import SimulatedRunner


async def test_the_runner_is_built_on_the_thread_that_runs_its_steps(monkeypatch, tiny_model_dir):
    import worker_service.model_runner as model_runner

    built_on: list[int] = []
    real = model_runner.ModelRunner

    def recording_runner(config):
        built_on.append(threading.get_ident())
        return real(config)

    monkeypatch.setattr(model_runner, "ModelRunner", recording_runner)
    config = ModelRunnerConfig(model=tiny_model_dir, num_blocks=64, max_num_seqs=4, dtype="float32")
    worker = WorkerApp(WorkerSettings(runner=config, port=0, metrics_port=-1, drain_grace_s=1))
    await worker.start()
    try:
        steps_on = await asyncio.get_running_loop().run_in_executor(worker.servicer._executor, threading.get_ident)
        assert built_on == [steps_on]
        assert steps_on != threading.get_ident()  # not the event loop's thread either
    finally:
        await worker.drain(1)


class WaitingForTheNextStep(SimulatedRunner):
    """Its first non-empty step waits (up to 5 s) until the worker holds two requests: until it has
    received and decoded the step sent after this one."""

    def __init__(self) -> None:
        super().__init__(INFO, step_latency=(0.0, 0.0))
        self.servicer: WorkerServicer | None = None
        self.saw_the_next_step: bool | None = None
        self.threads: set[int] = set()

    def execute_model(self, scheduler_output):
        self.threads.add(threading.get_ident())
        if scheduler_output.total_num_scheduled_tokens and self.saw_the_next_step is None:
            deadline = time.monotonic() + 5
            while self.servicer.num_held < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            self.saw_the_next_step = self.servicer.num_held == 2
        return super().execute_model(scheduler_output)


@pytest.mark.service
async def test_a_step_sent_ahead_is_decoded_while_the_one_before_runs():
    """With asynchronous scheduling the scheduler sends a step while the one before it runs; the
    worker takes it in then, so its runner thread starts it the moment the first ends (no hop
    through the event loop between them), and the outputs come back in order."""
    from scheduler_service.core.config import SchedulerConfig
    from scheduler_service.core.scheduler import Scheduler
    from tests.services.test_async_worker_failure import served
    from tests.services.test_engine_loop import make_request

    runner = WaitingForTheNextStep()
    runner.servicer = WorkerServicer(runner, worker_id="w", max_num_seqs=8, max_num_batched_tokens=64)
    async with served(runner.servicer) as (client, description):
        steps = []
        for rid in ("a", "b"):  # two plans, one new request each
            core = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), description)
            core.add_request(make_request(rid))
            steps.append(core.schedule())
        for step in steps:
            await client.send(step)
        outputs = [await asyncio.wait_for(client.receive(), 10) for _ in steps]
    assert runner.saw_the_next_step is True
    assert [list(o.sampled_token_ids) for o in outputs] == [["a"], ["b"]]
    assert len(runner.threads) == 1 and threading.get_ident() not in runner.threads
