"""The scheduler's per-worker engine loop against a scripted worker (a test double for the Step
stream: every request that reaches the end of its tokens samples token 7)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from servicekit.contract.scheduling import SchedulingConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine import WorkerEngine
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import ModelRunnerOutput
from servicekit.contract.worker import WorkerDescription

INFO = WorkerDescription(model="m", num_blocks=64, block_size=4, max_model_len=128, vocab_size=100, eos_token_ids=(2,))


class ScriptedWorker:
    address = "scripted:1"

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}  # request id -> known tokens
        self.sent: list = []  # steps sent, not answered (WorkerClient's send / receive)
        self.max_in_flight = 0

    async def send(self, so):
        self.sent.append(so)
        self.max_in_flight = max(self.max_in_flight, len(self.sent))

    async def receive(self):
        return await self.step(self.sent.pop(0))

    async def step(self, so):
        for r in so.scheduled_new_reqs:
            self.tokens[r.request_id] = len(r.prompt_token_ids) + len(r.output_token_ids)
        sampled = {}
        cached = so.scheduled_cached_reqs
        computed = {r.request_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, num_computed_tokens in computed.items():
            if num_computed_tokens + so.num_scheduled_tokens[rid] >= self.tokens[rid]:
                sampled[rid] = [7]
                self.tokens[rid] += 1
        await asyncio.sleep(0)
        return ModelRunnerOutput(sampled_token_ids=sampled)

    async def close(self) -> None:
        pass


class GatedQueue:
    """Records publishes; while ``gate`` is clear, publishing blocks (a slow Redis)."""

    def __init__(self) -> None:
        self.finished: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.publishing = asyncio.Event()

    def route(self, outputs):
        return outputs

    async def publish_routed(self, outputs, finished_entry_ids) -> None:
        self.publishing.set()
        await self.gate.wait()
        self.finished.extend(finished_entry_ids)


def make_engine(queue) -> WorkerEngine:
    core = Scheduler(SchedulingConfig(max_num_seqs=8, max_num_batched_tokens=64), INFO)
    return WorkerEngine(ScriptedWorker(), replace(INFO, worker_id="w", max_num_seqs=8, max_num_batched_tokens=64), core, queue, max_queued=8,
                        on_finished=lambda n, a: None)


def make_request(rid: str, max_tokens: int = 3) -> Request:
    return Request(rid, [5, 6, 8], SamplingParams(max_tokens=max_tokens, seed=1, ignore_eos=True))


@pytest.mark.asyncio
async def test_request_submitted_while_the_engine_publishes_a_refusal_is_not_left_waiting():
    queue = GatedQueue()
    engine = make_engine(queue)
    task = asyncio.create_task(engine.run())
    queue.gate.clear()
    # more KV than the worker has: the core refuses it (the length rule was checked at the gateway)
    engine.submit(make_request("too-big", max_tokens=INFO.num_blocks * INFO.block_size), "entry-refused")
    await queue.publishing.wait()  # the engine is publishing the refusal; its core is empty
    engine.submit(make_request("b"), "entry-b")
    queue.gate.set()
    await asyncio.wait_for(engine.wait_idle(), 5)
    assert queue.finished == ["entry-refused", "entry-b"]
    task.cancel()


@pytest.mark.asyncio
async def test_abort_frees_the_request_and_acks_it():
    queue = GatedQueue()
    engine = make_engine(queue)
    task = asyncio.create_task(engine.run())
    engine.submit(make_request("long", max_tokens=100), "entry-long")
    while engine.core.num_running == 0:
        await asyncio.sleep(0)
    engine.abort("long")
    await asyncio.wait_for(engine.wait_idle(), 5)
    assert queue.finished == ["entry-long"]
    assert engine.core.stats().kv_cache_usage == 0.0
    task.cancel()
