"""Careless and hostile requests at the gateway: huge text is
refused by its size and tokenized off the event loop, undecodable bytes and bad chat turns are
INVALID_ARGUMENT naming the field, and a deadline that passes in the queue is DEADLINE_EXCEEDED.
In-process stack, real Redis, real gRPC, the real tokenizer."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import grpc
import pytest

from pagedserve.aio_client import AsyncClient
from pagedserve.errors import DeadlineExceededError, InvalidArgumentError
from servicekit.proto.channel import CHANNEL_OPTIONS
from servicekit.proto.pb import generation_pb2, generation_pb2_grpc

from stack.test_health import SERVING, health

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]

HEALTH_BOUND_S = 1.0  # generous for a loaded 2-core machine; the goal is 100 ms


async def slowest_health_while(address: str, call) -> tuple[float, object]:
    """Run ``call`` while asking the gateway's health every 20 ms; returns the longest a health
    answer came late (seconds: its round trip plus any stall of the event loop the in-process
    gateway shares with this test) and ``call``'s result (or the exception it raised)."""
    began = time.perf_counter()
    task = asyncio.ensure_future(call)
    slowest, checks = 0.0, 0
    while not task.done():
        start = time.perf_counter()
        await asyncio.sleep(0.02)
        assert await health(address) == SERVING
        slowest, checks = max(slowest, time.perf_counter() - start - 0.02), checks + 1
    try:
        result = task.result()
    except Exception as exc:
        result = exc
    print(f"slowest of {checks} gateway health answers during a {time.perf_counter() - began:.2f} s call: "
          f"{slowest * 1000:.1f} ms; load {os.getloadavg()}")
    return slowest, result


async def test_a_10mb_text_is_refused_by_its_size_and_health_keeps_answering(stack):
    text = "lorem ipsum dolor sit amet " * (10 * 1024 * 1024 // 27)
    async with AsyncClient(stack.gateway_address, timeout=120, retries=0) as client:
        slowest, tokenized = await slowest_health_while(stack.gateway_address, client.tokenize(text))
        assert slowest < HEALTH_BOUND_S
        assert isinstance(tokenized, InvalidArgumentError) and tokenized.field == "text", tokenized
        with pytest.raises(InvalidArgumentError) as generate:
            await client.generate(text, max_tokens=2)
    assert generate.value.field == "prompt" and "bytes" in generate.value.message


async def test_health_answers_while_a_large_prompt_is_tokenized(stack, hf_tokenizer):
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig

    # A gateway whose size limit lets 2 MB through (as a 128k-token model's would), so the
    # tokenizer really works on it before the prompt is refused for its token count.
    gateway = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=0, redis_url=stack.redis_url, read_block_ms=200,
                                         prompt_bytes_per_token=10_000), hf_tokenizer=hf_tokenizer)
    await gateway.start()
    address = f"127.0.0.1:{gateway.port}"
    text = "lorem ipsum dolor sit amet " * (2 * 1024 * 1024 // 27)
    try:
        async with AsyncClient(address, timeout=120, retries=0) as client:
            slowest, refused = await slowest_health_while(address, client.generate(text, max_tokens=2))
    finally:
        await gateway.drain(1)
    assert isinstance(refused, InvalidArgumentError) and "tokens" in refused.message, refused
    assert slowest < HEALTH_BOUND_S


def _prompt_field(data: bytes) -> bytes:
    """GenerateRequest.prompt (field 2, length-delimited) holding raw ``data``."""
    return bytes([2 << 3 | 2, len(data)]) + data


UNDECODABLE = {
    "invalid utf-8 in prompt": _prompt_field(b"\xff\xfe"),
    "truncated": bytes([2 << 3 | 2, 5]) + b"ab",
    "garbage": b"\xff\xff\xff\xff\xff",
}


@pytest.mark.parametrize("name", list(UNDECODABLE))
async def test_undecodable_request_bytes_are_invalid_argument_without_an_error_log(stack, caplog, name):
    raw = UNDECODABLE[name]
    caplog.set_level(logging.INFO)
    async with grpc.aio.insecure_channel(stack.gateway_address, options=CHANNEL_OPTIONS) as channel:
        generate = channel.unary_stream("/pagedserve.v1.Generation/Generate")  # bytes in, bytes out
        tokenize = channel.unary_unary("/pagedserve.v1.Generation/Tokenize")
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            async for _ in generate(raw, timeout=10):
                pass
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await tokenize(raw, timeout=10)
    for err in (streamed.value, unary.value):
        print(f"{name}: {err.code()} {err.details()!r}")
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Exception" not in err.details() and len(err.details()) < 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert await health(stack.gateway_address) == SERVING


BAD_TURNS = [
    ("messages[1].role", [("user", "hi"), ("wizard", "abracadabra")]),
    ("messages[0].role", [("", "no role")]),
]


@pytest.mark.parametrize(("field", "turns"), BAD_TURNS, ids=[f for f, _ in BAD_TURNS])
async def test_chat_turns_with_unknown_roles_or_no_content_are_refused_naming_the_field(stack, field, turns):
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in turns])
    async with grpc.aio.insecure_channel(stack.gateway_address, options=CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as generated:
            async for _ in stub.Generate(generation_pb2.GenerateRequest(chat=chat), timeout=30):
                pass
        with pytest.raises(grpc.aio.AioRpcError) as tokenized:
            await stub.Tokenize(generation_pb2.TokenizeRequest(chat=chat), timeout=30)
    for err in (generated.value, tokenized.value):
        print(f"{field}: {err.code()} {err.details()!r}")
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(err.trailing_metadata())["pagedserve-field"] == field


async def test_the_sdk_refuses_a_chat_turn_without_content_with_its_typed_error(stack):
    async with AsyncClient(stack.gateway_address, timeout=30, retries=0) as client:
        with pytest.raises(InvalidArgumentError) as info:
            await client.chat([{"role": "system", "content": "be brief"}, {"role": "user"}], max_tokens=2)
    print(f"SDK: {type(info.value).__name__} {info.value}")
    assert info.value.field == "messages[1].content"


class _ClockAhead:
    """The time module as seen from a host whose clock runs ``skew_s`` ahead."""

    def __init__(self, skew_s: float) -> None:
        self._skew_s = skew_s

    def time(self) -> float:
        return time.time() + self._skew_s

    def __getattr__(self, name):
        return getattr(time, name)


async def test_a_deadline_passed_in_the_queue_reaches_the_client_as_deadline_exceeded(stack, monkeypatch):
    import scheduler_service.service as scheduler_module

    # The scheduler's clock 60 s ahead of the gateway's: every request it pulls has a deadline
    # (set by the gateway from the call's 30 s timeout) that already passed, so it refuses the
    # request from the queue while the client's call is still live.
    monkeypatch.setattr(scheduler_module, "time", _ClockAhead(60.0))
    async with AsyncClient(stack.gateway_address, retries=0) as client:
        with pytest.raises(DeadlineExceededError) as info:
            await client.generate("Too late already", max_tokens=4, timeout=30)
    print(f"client got: {info.value.code} {info.value}")
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_more_streams_than_a_connection_may_open_queue_at_the_client_and_all_finish(stack, hf_tokenizer):
    """A client with more concurrent calls than the gateway's --max-concurrent-streams: gRPC's client
    holds the extra calls until a stream closes, so every call finishes, none refused, even with
    calls cancelled mid-stream meanwhile (gRPC's default server counting also refused streams the
    client had already closed)."""
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig

    gateway = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=0, redis_url=stack.redis_url,
                                         read_block_ms=200, max_concurrent_streams=4), hf_tokenizer=hf_tokenizer)
    await gateway.start()
    try:
        async with AsyncClient(f"127.0.0.1:{gateway.port}", timeout=120, retries=0) as client:
            await client.generate("warm", max_tokens=1)  # the connection's settings are known

            async def one(i: int) -> str:
                async with client.stream(f"prompt {i}", max_tokens=6, temperature=0, ignore_eos=True) as stream:
                    count = 0
                    async for chunk in stream:
                        count += len(chunk.token_ids)
                        if i % 5 == 0:
                            return "cancelled"  # leaving the block cancels the call
                    return "finished" if count == 6 else f"{count} tokens"

            results = await asyncio.gather(*(one(i) for i in range(24)), return_exceptions=True)
    finally:
        await gateway.drain(1)
    assert sorted(map(str, results)) == ["cancelled"] * 5 + ["finished"] * 19, results


async def test_a_redis_out_of_memory_refuses_admission_saying_why(stack, hf_tokenizer):
    """Redis that answers but refuses writes (maxmemory reached) is UNAVAILABLE with Redis's reason,
    not 'unreachable'; the same call succeeds once Redis takes writes again."""
    from pagedserve.errors import UnavailableError

    from helpers.stack import queue_limited_gateway

    async with queue_limited_gateway(stack, hf_tokenizer, "oom:", max_queued=10) as (gateway, redis, keys):
        before = (await redis.config_get("maxmemory"))["maxmemory"]
        async with AsyncClient(f"127.0.0.1:{gateway.port}", timeout=30, retries=0) as client:
            await redis.config_set("maxmemory", 1)  # every write is now refused with OOM
            try:
                with pytest.raises(UnavailableError) as refused:
                    async for _ in client.stream("Hello", max_tokens=2):
                        pass
            finally:
                await redis.config_set("maxmemory", before)
            assert "refused the admission" in refused.value.message and "OOM" in refused.value.message, refused.value
            # Writes taken again: the same call is admitted (it waits in the queue: no scheduler reads "oom:").
            stream = client.stream("Hello", max_tokens=2, request_id="oom-after")
            reader = asyncio.ensure_future(stream.__anext__())
            deadline = time.monotonic() + 10
            while not await redis.exists(keys.output("oom-after")):
                assert time.monotonic() < deadline and not reader.done(), reader
                await asyncio.sleep(0.05)
            reader.cancel()
            await stream.aclose()


async def test_an_http_call_asking_for_too_many_requests_is_refused_at_once(stack, hf_tokenizer):
    """One call's prompts × n past --max-requests-per-call is a 400 before any prompt is tokenized
    or admitted (20,000 prompts took the gateway 12 s to refuse one by one); it names n for one prompt."""
    from helpers.stack import post_json, queue_limited_gateway

    async with queue_limited_gateway(stack, hf_tokenizer, "many:", max_queued=100,
                                     max_requests_per_call=4) as (gateway, redis, keys):
        def post(body: dict) -> tuple[int, dict]:
            return post_json(f"http://127.0.0.1:{gateway.http_port}/v1/completions", body)
        status, reply = await asyncio.to_thread(post, {"prompt": ["Hi"] * 3, "n": 2, "max_tokens": 1})
        assert status == 400 and reply["error"]["param"] == "prompt", reply
        assert "6 requests" in reply["error"]["message"] and "at most 4" in reply["error"]["message"]
        status, reply = await asyncio.to_thread(post, {"prompt": "Hi", "n": 5, "max_tokens": 1})
        assert status == 400 and reply["error"]["param"] == "n", reply
        assert not await redis.keys(keys.output("*"))  # nothing was admitted
