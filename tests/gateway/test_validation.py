"""Every bad input is INVALID_ARGUMENT naming its field, and the services stay healthy."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.aio_client import AsyncClient
from pagedserve.errors import InvalidArgumentError

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]

MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings

BAD_INPUTS = [
    ("prompt", dict(prompt="")),
    ("prompt", dict(prompt="word " * 600)),  # the prompt alone is over max_model_len
    ("max_tokens", dict(prompt="hello", max_tokens=MAX_MODEL_LEN)),  # prompt + max_tokens over it
    ("max_tokens", dict(prompt="hello", max_tokens=0)),
    ("max_tokens", dict(prompt="hello", max_tokens=-5)),
    ("temperature", dict(prompt="hello", temperature=-0.5)),
    ("top_p", dict(prompt="hello", top_p=0.0)),
    ("top_p", dict(prompt="hello", top_p=1.5)),
    ("top_k", dict(prompt="hello", top_k=-2)),
    ("top_k", dict(prompt="hello", top_k=0)),
    ("min_p", dict(prompt="hello", min_p=-0.1)),
    ("min_p", dict(prompt="hello", min_p=1.5)),
    ("stop", dict(prompt="hello", stop=[f"s{i}" for i in range(17)])),
    ("stop", dict(prompt="hello", stop=["x" * 257])),
    ("model", dict(prompt="hello", model="no-such-model")),
    ("request_id", dict(prompt="hello", request_id="spaces are not allowed")),
    ("prompt_token_ids", dict(prompt=[1, 2, 10**6])),
    ("user", dict(prompt="hello", user="u" * 257)),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD_INPUTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_INPUTS)])
async def test_bad_input_is_invalid_argument_naming_the_field(stack, field, kwargs):
    async with AsyncClient(stack.gateway_address, timeout=30) as client:
        with pytest.raises(InvalidArgumentError) as info:
            await client.generate(**kwargs)
    assert info.value.field == field
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_services_stay_healthy_and_serve_after_bad_inputs(stack):
    async with AsyncClient(stack.gateway_address, timeout=30) as client:
        for _field, kwargs in BAD_INPUTS:
            with pytest.raises(InvalidArgumentError):
                await client.generate(**kwargs)
        completion = await client.generate("hello", max_tokens=4, ignore_eos=True)
    assert len(completion.token_ids) == 4
    for address in (stack.gateway_address, stack.scheduler_address, stack.worker_address):
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
