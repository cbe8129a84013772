"""Worker.Reset is refused while a scheduler drives the worker: over real gRPC,
a Reset during an open Step stream is FAILED_PRECONDITION and the stream goes on undisturbed."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from servicekit.contract.scheduling import SchedulingConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.worker_client import WorkerClient, connect
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.worker import WorkerDescription
from worker_service.grpc_server import WorkerServicer, build_server
from worker_service.simulated_runner import SimulatedRunner

pytestmark = [pytest.mark.service, pytest.mark.asyncio]

INFO = WorkerDescription(model="m", num_blocks=64, block_size=4, max_model_len=128, vocab_size=1000, eos_token_ids=(2,))


@pytest_asyncio.fixture
async def worker_address():
    """A worker gRPC server on a free loopback port around a runner that sleeps 0 per step."""
    servicer = WorkerServicer(SimulatedRunner(INFO, step_latency=(0.0, 0.0)), worker_id="w", max_num_seqs=8,
                              max_num_batched_tokens=64)
    server = build_server(servicer)
    port = server.bind("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    servicer.stopping = True
    await server.drain(0.5)
    servicer.close()


async def test_reset_is_refused_while_a_step_stream_is_open(worker_address):
    client, _ = await connect(worker_address)
    core = Scheduler(SchedulingConfig(max_num_batched_tokens=64), INFO)
    core.add_request(Request("r", [10, 11, 12], SamplingParams(max_tokens=5, seed=1, ignore_eos=True)))
    tokens: list[int] = []
    plan = core.schedule()
    for out in core.update_from_output(plan, await client.step(plan)):
        tokens.extend(out.new_token_ids)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.reset()
    print(f"Reset during a Step stream: {info.value.code().name}: {info.value.details()}")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    # The request the scheduler drives is intact on the worker: the stream carries on to the end.
    while core.has_unfinished_requests():
        plan = core.schedule()
        for out in core.update_from_output(plan, await client.step(plan)):
            tokens.extend(out.new_token_ids)
    assert len(tokens) == 5
    await client.close()


async def test_reset_is_allowed_once_the_stream_is_closed(worker_address):
    client, _ = await connect(worker_address)
    await client.close()
    # The worker notices the cancelled stream asynchronously; until then Reset is still refused.
    # Once it has, Reset succeeds and finds nothing left (closing the stream dropped its requests).
    reset_client = WorkerClient(worker_address)
    codes: list[grpc.StatusCode] = []
    for _ in range(100):
        try:
            num_dropped = await reset_client.reset()
            break
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
            await asyncio.sleep(0.05)
    else:
        pytest.fail("Reset stayed refused after the Step stream closed")
    await reset_client.close()
    assert num_dropped == 0
    assert set(codes) <= {grpc.StatusCode.FAILED_PRECONDITION}
