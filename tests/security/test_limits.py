"""The gateway's message-size limit: a request over ``max_message_bytes`` is refused by gRPC
with RESOURCE_EXHAUSTED before any of it is parsed, and the gateway goes on serving."""

from __future__ import annotations

import grpc
import pytest

from pagedserve.aio_client import CLIENT_CHANNEL_OPTIONS, AsyncClient
from servicekit.grpc_auth import bearer_metadata
from servicekit.proto.pb import generation_pb2, generation_pb2_grpc
from servicekit.tls import aio_channel

from .conftest import KEYS

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_request_over_the_message_limit_is_resource_exhausted(secure_stack, pki):
    limit = secure_stack.gateway.settings.max_message_bytes
    request = generation_pb2.GenerateRequest(prompt="a" * (limit + 1))
    async with aio_channel(secure_stack.gateway_address, pki.client, CLIENT_CHANNEL_OPTIONS) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(
            request, timeout=60, metadata=bearer_metadata(KEYS["alice"]))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    async with AsyncClient(secure_stack.gateway_address, api_key=KEYS["alice"], tls=pki.client, timeout=60) as sdk:
        assert len((await sdk.generate("Still here", max_tokens=3, ignore_eos=True)).token_ids) == 3
