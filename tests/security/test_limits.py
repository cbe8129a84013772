"""The gateway's message-size limit: a request over ``max_message_bytes`` is refused by gRPC
with RESOURCE_EXHAUSTED before any of it is parsed, and the gateway goes on serving."""

from __future__ import annotations

import grpc
import pytest

from pagedserve.aio_client import CLIENT_CHANNEL_OPTIONS, AsyncClient
from servicekit.auth import bearer_metadata
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


async def test_a_key_past_its_tokens_per_minute_is_resource_exhausted(secure_stack, hf_tokenizer):
    """A second gateway on the secure stack's Redis (plaintext, keys given inline) with a budget
    of 30 tokens per key per minute: a key is refused once it spent that, the other is not."""
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig
    from pagedserve.errors import ResourceExhaustedError

    from .conftest import PREFIX

    gateway = GatewayApp(GatewayConfig(
        model=secure_stack.model, port=0, redis_url=secure_stack.gateway.settings.redis_url, key_prefix=PREFIX,
        read_block_ms=200, drain_grace_s=1, api_keys=(KEYS["alice"], KEYS["bob"]), max_tokens_per_key_per_minute=30),
        hf_tokenizer=hf_tokenizer)
    await gateway.start()
    try:
        address = f"127.0.0.1:{gateway.port}"
        async with AsyncClient(address, api_key=KEYS["alice"], timeout=60) as alice:
            spent = 0
            with pytest.raises(ResourceExhaustedError, match="tokens in the last minute"):
                for _ in range(10):
                    completion = await alice.generate("Count the tokens", max_tokens=8, ignore_eos=True)
                    spent += completion.usage.prompt_tokens + completion.usage.completion_tokens
            assert 30 <= spent < 30 + 8 + 10  # refused once the budget is used, not before
        async with AsyncClient(address, api_key=KEYS["bob"], timeout=60) as bob:
            assert len((await bob.generate("Count the tokens", max_tokens=8, ignore_eos=True)).token_ids) == 8
    finally:
        await gateway.drain(1)
