"""SIGTERM semantics of each service: a gateway (NOT_SERVING at once, new calls refused, live
streams finish within the grace, those still live after it go on through another gateway), the
worker and the scheduler (NOT_SERVING at once, held requests finish, then the server stops), and a
worker lost mid-generation (its request waits for another worker and resumes there). The gateway
tests drain a gateway of their own beside the shared stack; the others each build a stack of their
own under their own key prefix, so the shared one stays up."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from pagedserve.aio_client import AsyncClient
from pagedserve.errors import UnavailableError
from servicekit.contract.sampling_params import SamplingParams

from helpers.stack import DTYPE, MAX_NUM_SEQS, NUM_BLOCKS
from .test_health import NOT_SERVING, SERVING, health

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]


async def start_worker(prefix: str, tiny_model_dir, hf_model, redis_url, *, step_delay_s: float = 0.0):
    from worker_service.config import ModelRunnerConfig
    from worker_service.config import WorkerConfig
    from worker_service.main import WorkerApp
    from worker_service.model_runner import ModelRunner

    runner = ModelRunner(ModelRunnerConfig(model=tiny_model_dir, num_blocks=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS,
                                           dtype=DTYPE), hf_model=hf_model)
    worker = WorkerApp(WorkerConfig(runner=runner.config, port=0, redis_url=redis_url, key_prefix=prefix,
                                      step_delay_s=step_delay_s), runner=runner)
    await worker.start()
    return worker


@contextlib.asynccontextmanager
async def own_stack(prefix: str, tiny_model_dir, hf_model, hf_tokenizer, redis_url, *, registry: bool = False,
                    step_delay_s: float = 0.0):
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig
    from scheduler_service.service import SchedulerApp
    from scheduler_service.config import SchedulerConfig

    worker = await start_worker(prefix, tiny_model_dir, hf_model, redis_url, step_delay_s=step_delay_s)
    scheduler = SchedulerApp(SchedulerConfig(redis_url=redis_url, key_prefix=prefix, port=0,
                                               workers=() if registry else (worker.address,), poll_block_ms=200,
                                               discovery_interval_s=0.2))
    await scheduler.start()
    await scheduler.wait_for_workers(1)
    gateway = GatewayApp(GatewayConfig(model=tiny_model_dir, port=0, http_port=0, redis_url=redis_url, key_prefix=prefix,
                                         read_block_ms=200), hf_tokenizer=hf_tokenizer)
    await gateway.start()
    try:
        yield worker, scheduler, gateway
    finally:
        await gateway.drain(1)
        for app in (scheduler, worker):
            if not app.lifecycle.draining:
                await app.drain(1)


async def test_draining_gateway_is_not_serving_refuses_new_calls_and_finishes_live_streams(stack, hf_tokenizer):
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig

    gateway = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=0, redis_url=stack.redis_url, read_block_ms=200),
                         hf_tokenizer=hf_tokenizer)
    await gateway.start()
    address = f"127.0.0.1:{gateway.port}"
    async with AsyncClient(address, timeout=60, retries=0) as client:
        stream = client.stream("Drain me slowly", max_tokens=120, ignore_eos=True)
        first = await stream.__anext__()
        drain = asyncio.create_task(gateway.drain(grace_s=30))
        await asyncio.sleep(0.05)
        assert await health(address) == NOT_SERVING
        assert await health(address, "pagedserve.v1.Generation") == NOT_SERVING
        with pytest.raises(UnavailableError):
            await client.generate("too late", max_tokens=2)
        rest = [c async for c in stream]
        await asyncio.wait_for(drain, 30)
    tokens = len(first.token_ids) + sum(len(c.token_ids) for c in rest)
    assert tokens == 120 and rest[-1].finish_reason == "length"


async def test_a_drain_past_its_grace_hands_live_streams_to_another_gateway(stack, hf_tokenizer, llm):
    """Streams still live when the drain grace ends are ended UNAVAILABLE with their requests left
    running, so the SDK resumes them on the next gateway: every token once, the same as LLM's."""
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig
    from servicekit.contract.sampling_params import SamplingParams

    prompt, max_tokens = "Hand me over", 400
    expected = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    gateway = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=0, redis_url=stack.redis_url,
                                         read_block_ms=200), hf_tokenizer=hf_tokenizer)
    await gateway.start()
    async with AsyncClient(f"127.0.0.1:{gateway.port},{stack.gateway_address}", timeout=60) as client:
        stream = client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        chunks = [await stream.__anext__()]
        drain = asyncio.create_task(gateway.drain(grace_s=0.2))
        chunks += [c async for c in stream]
        await asyncio.wait_for(drain, 30)
        assert stream._failover.address_index == 1, "the stream ended before the grace did: nothing was handed over"
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert chunks[-1].finish_reason == "length"


async def test_draining_worker_and_scheduler_finish_what_they_hold(tiny_model_dir, hf_model, hf_tokenizer,
                                                                    redis_server):
    async with own_stack("drain:", tiny_model_dir, hf_model, hf_tokenizer, redis_server.url) as (
            worker, scheduler, gateway):
        scheduler_address = f"127.0.0.1:{scheduler.port}"
        async with AsyncClient(f"127.0.0.1:{gateway.port}", timeout=60) as client:
            stream = client.stream("Hold on", max_tokens=80, ignore_eos=True)
            first = await stream.__anext__()

            worker_drain = asyncio.create_task(worker.drain(grace_s=30))
            await asyncio.sleep(0.05)
            assert await health(worker.address) == NOT_SERVING
            scheduler_drain = asyncio.create_task(scheduler.drain(grace_s=30))
            await asyncio.sleep(0.05)
            assert await health(scheduler_address) == NOT_SERVING
            assert not worker_drain.done() and not scheduler_drain.done()  # a request is still held

            rest = [c async for c in stream]
            await asyncio.wait_for(asyncio.gather(worker_drain, scheduler_drain), 30)
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 80
        assert rest[-1].finish_reason == "length"


async def test_a_draining_worker_is_let_go_without_a_warning(tiny_model_dir, hf_model, hf_tokenizer, redis_server,
                                                             caplog):
    """A worker draining under its scheduler leaves the registry at once and finishes what it holds
    over several discovery passes: the scheduler sees it answer NOT_SERVING (no "Redis link is
    down?" warning), and lets it go with news, not a fault, once it stops holding nothing."""
    async with own_stack("drained:", tiny_model_dir, hf_model, hf_tokenizer, redis_server.url, registry=True,
                         step_delay_s=0.02) as (worker, scheduler, gateway):
        async with AsyncClient(f"127.0.0.1:{gateway.port}", timeout=60) as client:
            stream = client.stream("Leaving soon", max_tokens=60, ignore_eos=True)
            chunks = [await stream.__anext__()]
            with caplog.at_level(logging.INFO, logger="scheduler_service"):
                worker_drain = asyncio.create_task(worker.drain(grace_s=30))
                chunks += [c async for c in stream]  # ~1.2 s: several discovery passes of 0.2 s
                await asyncio.wait_for(worker_drain, 30)
                for _ in range(200):  # the scheduler lets the drained worker go
                    if "it held no requests" in caplog.text:
                        break
                    await asyncio.sleep(0.05)
    assert sum(len(c.token_ids) for c in chunks) == 60 and chunks[-1].finish_reason == "length"
    scheduler_records = [r for r in caplog.records if r.name.startswith("scheduler_service")]
    assert not [r.getMessage() for r in scheduler_records if r.levelno >= logging.WARNING]


async def test_worker_lost_mid_generation_resumes_on_the_next_worker_with_the_same_tokens(
        tiny_model_dir, hf_model, hf_tokenizer, redis_server, llm, caplog):
    prompt, max_tokens = "Interrupted", 300
    expected = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    async with own_stack("lost:", tiny_model_dir, hf_model, hf_tokenizer, redis_server.url, registry=True) as (
            worker, scheduler, gateway):
        async with AsyncClient(f"127.0.0.1:{gateway.port}", timeout=60, retries=0) as client:
            stream = client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            chunks = [await stream.__anext__()]
            caplog.set_level(logging.INFO, logger="scheduler_service")
            await worker.lifecycle.server.stop(0)  # the worker vanishes (no drain): its request waits
            replacement = await start_worker("lost:", tiny_model_dir, hf_model, redis_server.url)
            try:
                chunks += [c async for c in stream]
            finally:
                await replacement.drain(1)
        indices = [c.first_index + i for c in chunks for i in range(len(c.token_ids))]
        assert indices == list(range(max_tokens))  # every index once, in order
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        assert chunks[-1].finish_reason == "length"
        assert await health(f"127.0.0.1:{scheduler.port}") == SERVING
        assert scheduler.stats().num_resumed == 1 and scheduler.stats().num_aborted == 0
    lost = [r for r in caplog.records if worker.address in r.getMessage()]
    assert lost and not [r.getMessage() for r in lost if "draining" in r.getMessage()]  # gone, not draining
    assert any(r.levelno == logging.WARNING and "resuming its 1 requests" in r.getMessage() for r in lost)
