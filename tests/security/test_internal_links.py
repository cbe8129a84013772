"""Internal links: a worker with mutual TLS accepts a Step stream (or any call, health included)
only from a client whose certificate the shared CA signed; the whole stack serves with mTLS on
its internal links; without TLS a worker and a scheduler's admin server want the shared internal
token on every call but health checks. Certificates are made at test time (trustme)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.admin import async_scheduler_stats
from pagedserve.aio_client import AsyncClient
from pagedserve.errors import UnauthenticatedError, UnavailableError
from scheduler_service.worker_client import WorkerClient, WorkerLostError, connect
from servicekit.auth import bearer_metadata
from servicekit.contract.step import SchedulerOutput
from servicekit.proto.pb import worker_pb2, worker_pb2_grpc
from servicekit.tls import TlsFiles, aio_channel

from .conftest import KEYS

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOKEN = "internal-token-for-tests"


def _stranger_kinds(pki) -> dict[str, TlsFiles | None]:
    return {"plaintext": None, "no-client-cert": TlsFiles(ca_file=pki.ca), "other-ca-cert": pki.stranger}


@pytest.mark.parametrize("kind", ["plaintext", "no-client-cert", "other-ca-cert"])
async def test_a_worker_refuses_a_step_stream_from_a_client_the_ca_did_not_certify(secure_stack, pki, kind):
    tls = _stranger_kinds(pki)[kind]
    client = WorkerClient(secure_stack.worker.address, tls=tls)
    try:
        await client.open_stream()
        with pytest.raises(WorkerLostError, match="UNAVAILABLE"):  # the handshake fails: no RPC runs
            await client.step(SchedulerOutput())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.describe(timeout_s=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await client.close()
    assert secure_stack.scheduler.engines and all(e.connected for e in secure_stack.scheduler.engines.values())


async def test_a_certified_client_gets_through_the_handshake(secure_stack, pki):
    client = WorkerClient(secure_stack.worker.address, tls=pki.scheduler)
    try:
        description = await client.describe(timeout_s=10)
        assert description.worker_id == secure_stack.worker.settings.worker_id
        await client.open_stream()  # the worker is driven by the stack's scheduler: one stream at a time
        with pytest.raises(WorkerLostError, match="FAILED_PRECONDITION"):
            await client.step(SchedulerOutput())
    finally:
        await client.close()


async def test_the_stack_serves_end_to_end_with_mtls_on_internal_links(secure_stack, pki):
    async with AsyncClient(secure_stack.gateway_address, api_key=KEYS["alice"], tls=pki.client, timeout=60) as sdk:
        completions = [await sdk.generate(f"Request number {i}", max_tokens=12, ignore_eos=True) for i in range(3)]
    assert [len(c.token_ids) for c in completions] == [12, 12, 12]
    # The scheduler's certificate names "scheduler.internal", not the address dialed.
    admin_tls = dataclasses.replace(pki.scheduler, server_name="scheduler.internal")
    stats = await async_scheduler_stats(f"127.0.0.1:{secure_stack.scheduler.port}", tls=admin_tls, timeout=10)
    assert stats.num_finished >= 3 and [w.connected for w in stats.workers] == [True]
    with pytest.raises(UnavailableError):  # the admin server wants a certificate of the CA too
        await async_scheduler_stats(f"127.0.0.1:{secure_stack.scheduler.port}", timeout=5,
                                    tls=TlsFiles(ca_file=pki.ca, server_name="scheduler.internal"))


@pytest_asyncio.fixture(loop_scope="session")
async def token_worker(tiny_model_dir):
    """A plaintext worker (simulated runner: no model) that wants the internal token."""
    from worker_service.config import ModelRunnerConfig
    from worker_service.config import WorkerConfig
    from worker_service.main import WorkerApp

    app = WorkerApp(WorkerConfig(runner=ModelRunnerConfig(model=tiny_model_dir, num_blocks=64), port=0,
                                   internal_token=TOKEN, simulate_step_latency=(0.0, 0.0), drain_grace_s=1))
    await app.start()
    yield app
    await app.drain(1)


@pytest.mark.parametrize("metadata", [(), bearer_metadata("wrong-token")], ids=["no-token", "wrong-token"])
async def test_without_tls_every_internal_rpc_needs_the_token(token_worker, metadata):
    async with aio_channel(token_worker.address, None, []) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for call in (lambda: stub.Describe(worker_pb2.DescribeRequest(), timeout=5, metadata=metadata),
                     lambda: stub.Reset(worker_pb2.ResetRequest(), timeout=5, metadata=metadata)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        step = stub.Step(metadata=metadata)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await step.read()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # health stays open
    with pytest.raises(grpc.aio.AioRpcError) as err:  # what the scheduler's connect sees: it gives up
        await connect(token_worker.address, timeout_s=5, token="wrong-token" if metadata else "")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_scheduler_with_the_token_drives_a_token_worker(token_worker, redis_server):
    from scheduler_service.service import SchedulerApp
    from scheduler_service.config import SchedulerConfig

    client, description = await connect(token_worker.address, timeout_s=5, token=TOKEN)
    await client.close()
    assert description.worker_id == token_worker.settings.worker_id
    scheduler = SchedulerApp(SchedulerConfig(redis_url=redis_server.url, key_prefix="sectok:", port=0,
                                               workers=(token_worker.address,), internal_token=TOKEN,
                                               poll_block_ms=200, drain_grace_s=1))
    await scheduler.start()
    try:
        await scheduler.wait_for_workers(1, timeout_s=30)
        address = f"127.0.0.1:{scheduler.port}"
        with pytest.raises(UnauthenticatedError):  # its admin server wants the token as well
            await async_scheduler_stats(address, timeout=5)
        assert (await async_scheduler_stats(address, timeout=5, token=TOKEN)).workers
    finally:
        await scheduler.drain(1)
