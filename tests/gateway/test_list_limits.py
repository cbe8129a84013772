"""Every list a client sends is bounded at the gateway: one over its limit is
INVALID_ARGUMENT naming the field, before anything is queued; one at its limit is served."""

from __future__ import annotations

import grpc
import pytest

from servicekit.proto.generation import MAX_CHAT_MESSAGES
from pagedserve.aio_client import AsyncClient
from pagedserve.errors import InvalidArgumentError
from servicekit.contract.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]

TOO_LONG = [
    ("stop_token_ids", dict(prompt="hello", stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))),
    # The reported attack: a huge list (here 2 million ids, ~8 MB on the wire) is refused outright.
    ("stop_token_ids", dict(prompt="hello", min_tokens=2, stop_token_ids=[7] * 2_000_000)),
    ("stop", dict(prompt="hello", stop=["x"] * (MAX_STOP_STRINGS + 1))),
    ("allowed_token_ids", dict(prompt="hello", allowed_token_ids=[5] * (MAX_ALLOWED_TOKEN_IDS + 1))),
    ("messages", dict(messages=[{"role": "user", "content": "hi"}] * (MAX_CHAT_MESSAGES + 1))),
]


@pytest.mark.parametrize(("field", "kwargs"), TOO_LONG, ids=[f"{f}-{i}" for i, (f, _) in enumerate(TOO_LONG)])
async def test_a_list_over_its_limit_is_invalid_argument_naming_the_field(stack, field, kwargs):
    async with AsyncClient(stack.gateway_address, timeout=30) as client:
        with pytest.raises(InvalidArgumentError) as info:
            await client.generate(**kwargs)
    print(f"{field}: {info.value.code} {info.value}")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field == field


async def test_lists_at_their_limits_are_served(stack):
    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        completion = await client.generate(
            "hello", max_tokens=4, min_tokens=2, ignore_eos=True,
            stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)), stop=[f"never-{i}" for i in range(MAX_STOP_STRINGS)])
        assert len(completion.token_ids) >= 2
        # The longest conversation allowed (tokenized: it is longer than the tiny model's context).
        ids = await client.tokenize(messages=[{"role": "user", "content": "hi"}] * MAX_CHAT_MESSAGES)
        with pytest.raises(InvalidArgumentError) as info:
            await client.tokenize(messages=[{"role": "user", "content": "hi"}] * (MAX_CHAT_MESSAGES + 1))
    assert len(ids) > MAX_CHAT_MESSAGES
    assert info.value.field == "messages"
