"""Health checking and reflection of every service, the queue limit, and the SDK retrying while no
gateway answers. The gateway's drain is in test_drain.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedserve.aio_client import AsyncClient
from pagedserve.errors import ResourceExhaustedError

from helpers.stack import queue_limited_gateway

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


async def reflected_services(address: str) -> set[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        async for reply in call:
            return {s.name for s in reply.list_services_response.service}
    return set()


@pytest.mark.parametrize(("which", "service"), [
    ("gateway", "pagedserve.v1.Generation"),
    ("scheduler", "pagedserve.v1.SchedulerAdmin"),
    ("worker", "pagedserve.v1.Worker"),
])
async def test_each_service_reports_serving_and_lists_itself_by_reflection(stack, which, service):
    address = getattr(stack, f"{which}_address")
    assert await health(address) == SERVING
    assert await health(address, service) == SERVING
    assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= \
        await reflected_services(address)


async def test_queue_past_its_limit_is_resource_exhausted(stack, hf_tokenizer):
    """A stack prefix with no scheduler: requests wait in Redis; the third one is refused."""
    async with queue_limited_gateway(stack, hf_tokenizer, "qlimit:", 2) as (gateway, redis, keys):
        async with AsyncClient(f"127.0.0.1:{gateway.port}", timeout=30) as client:
            waiting = [asyncio.create_task(client.generate(f"queued {i}", max_tokens=4)) for i in range(2)]
            while await redis.xlen(keys.requests) < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(ResourceExhaustedError):
                await client.generate("one too many", max_tokens=4)
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        assert await health(f"127.0.0.1:{gateway.port}") == SERVING


async def test_sdk_retries_unavailable_until_a_gateway_answers(stack, hf_tokenizer):
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig

    from helpers.stack import free_port

    port = free_port()
    async with AsyncClient(f"127.0.0.1:{port}", timeout=30, retries=6) as client:
        pending = asyncio.create_task(client.generate("patience", max_tokens=3, ignore_eos=True))
        await asyncio.sleep(0.5)  # the first tries find nothing listening: UNAVAILABLE
        assert not pending.done()
        gateway = GatewayApp(GatewayConfig(model=stack.model, port=port, http_port=0, redis_url=stack.redis_url,
                                             read_block_ms=200), hf_tokenizer=hf_tokenizer)
        await gateway.start()
        try:
            completion = await asyncio.wait_for(pending, 20)
        finally:
            await gateway.drain(1)
    assert len(completion.token_ids) == 3
