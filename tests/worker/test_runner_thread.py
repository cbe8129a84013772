"""The worker runs every torch call on one thread, loading included.

Each thread that enters OpenMP gets a thread team of its own; a runner loaded on one thread and
stepped on another leaves two teams contending for the same cores (measured on 2 CPU cores: 1.65
cores busy instead of 1.99, the served stack 12 % slower than the in-process engine).
"""

from __future__ import annotations

import asyncio
import os
import threading

from worker_service.config import ModelRunnerConfig, WorkerConfig
from worker_service.main import WorkerApp


async def test_the_runner_is_built_on_the_thread_that_runs_its_steps(monkeypatch, tiny_model_dir):
    import worker_service.model_runner as model_runner

    built_on: list[int] = []
    real = model_runner.ModelRunner

    def recording_runner(config):
        built_on.append(threading.get_ident())
        return real(config)

    monkeypatch.setattr(model_runner, "ModelRunner", recording_runner)
    config = ModelRunnerConfig(model=tiny_model_dir, num_blocks=64, max_num_seqs=4, dtype="float32")
    placement = os.sched_getaffinity(0)
    worker = WorkerApp(WorkerConfig(runner=config, port=0, metrics_port=-1, drain_grace_s=1))
    await worker.start()
    try:
        steps_on = await asyncio.get_running_loop().run_in_executor(worker.servicer._executor, threading.get_ident)
        assert built_on == [steps_on]
        assert steps_on != threading.get_ident()  # not the event loop's thread either
        # started inside another program (not `pagedserve worker`), it never pins that program's threads
        assert os.sched_getaffinity(0) == placement
        assert await asyncio.get_running_loop().run_in_executor(
            worker.servicer._executor, os.sched_getaffinity, 0) == placement
    finally:
        await worker.drain(1)
