"""GenerateMany: many generations over one gRPC call (the asyncio SDK's default), through the whole
stack (in-process services, real Redis, real gRPC, tiny model)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedserve.aio_client import AsyncClient
from pagedserve.errors import DeadlineExceededError, InvalidArgumentError
from servicekit.proto.pb import generation_pb2, generation_pb2_grpc, sampling_pb2
from helpers.stack import scheduler_stats, wait_until_kv_free

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]


def start(stream_id: int, prompt_ids, max_tokens: int, *, timeout_s: float = 0.0, **request):
    return generation_pb2.GenerateManyRequest(
        stream_id=stream_id, timeout_s=timeout_s, start=generation_pb2.GenerateRequest(
            prompt_token_ids=generation_pb2.TokenIds(ids=prompt_ids),
            sampling_params=sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
            **request))


class RawCall:
    """A GenerateMany call driven by hand: ``send`` messages, ``events(n)`` reads until n streams ended."""

    def __init__(self, channel) -> None:
        self._out: asyncio.Queue = asyncio.Queue()
        self.call = generation_pb2_grpc.GenerationStub(channel).GenerateMany(self._requests(), timeout=60)
        self.responses: list[generation_pb2.GenerateManyResponse] = []
        self.events: dict[int, list[generation_pb2.GenerateManyEvent]] = {}
        self.ended: set[int] = set()

    async def _requests(self):
        while (msg := await self._out.get()) is not None:
            yield msg

    def send(self, msg) -> None:
        self._out.put_nowait(msg)

    def half_close(self) -> None:
        self._out.put_nowait(None)

    async def read(self) -> generation_pb2.GenerateManyResponse:
        response = await self.call.read()
        if response is not grpc.aio.EOF:
            self.responses.append(response)
            for event in response.events:
                self.events.setdefault(event.stream_id, []).append(event)
                if event.error_code or event.response.finish_reason:
                    self.ended.add(event.stream_id)
        return response

    async def until_ended(self, stream_ids) -> dict[int, list[generation_pb2.GenerateManyEvent]]:
        """Events per stream (all read so far) once each of ``stream_ids`` has its last (a finish or an error)."""
        while not self.ended.issuperset(stream_ids):
            assert await self.read() is not grpc.aio.EOF, "the call ended with streams open"
        return self.events


def tokens_of(events) -> list[int]:
    out: list[int] = []
    for event in events:
        assert event.response.first_index == len(out)  # in order, none lost or repeated
        out.extend(event.response.token_ids)
    return out


async def test_multiplexed_streams_give_what_separate_calls_give(stack):
    prompts = [f"Request {i} says" for i in range(12)]

    async def run(client: AsyncClient):
        async def one(i: int):
            c = await client.generate(prompts[i], max_tokens=6 + 2 * i, temperature=0, ignore_eos=True)
            return list(c.token_ids), c.text, c.finish_reason, c.usage.completion_tokens
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        multiplexed = await run(client)
    async with AsyncClient(stack.gateway_address, timeout=60, multiplex=False) as client:
        separate = await run(client)
    assert multiplexed == separate
    assert [r[3] for r in multiplexed] == [6 + 2 * i for i in range(12)]


async def test_one_response_carries_the_chunks_of_many_generations(stack):
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        raw = RawCall(channel)
        for sid in range(1, 9):
            raw.send(start(sid, [5 + sid, 17, 23], 24))
        events = await raw.until_ended(range(1, 9))
        raw.half_close()
        assert await raw.call.read() is grpc.aio.EOF  # half-closed with nothing open: the call ends
        assert await raw.call.code() == grpc.StatusCode.OK
    for sid in range(1, 9):
        assert len(tokens_of(events[sid])) == 24
        assert events[sid][-1].response.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    num_events = sum(len(r.events) for r in raw.responses)
    # 8 generations decode in one batch: their chunks of a step travel together.
    assert max(len(r.events) for r in raw.responses) >= 4
    assert len(raw.responses) * 2 <= num_events


async def test_a_bad_generation_ends_alone_with_its_field(stack):
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        raw = RawCall(channel)
        raw.send(start(1, [], 8))  # no prompt
        raw.send(start(2, [3, 4, 5], 8))
        raw.send(start(3, [3, 4, 5], 8, timeout_s=-1.0))
        events = await raw.until_ended([1, 2, 3])
        raw.half_close()
    assert events[1][-1].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert events[1][-1].error_field == "prompt"
    assert events[3][-1].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert events[3][-1].error_field == "timeout_s"
    assert len(tokens_of(events[2])) == 8


async def test_sdk_raises_a_multiplexed_generations_typed_error(stack):
    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        good = asyncio.ensure_future(client.generate("fine", max_tokens=5, ignore_eos=True))
        with pytest.raises(InvalidArgumentError) as info:
            await client.generate([10**6], max_tokens=5)  # past the vocabulary
        assert info.value.field == "prompt_token_ids"
        assert len((await good).token_ids) == 5


async def test_a_stream_id_already_open_fails_the_call(stack):
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        raw = RawCall(channel)
        raw.send(start(1, [3, 4, 5], 400))
        raw.send(start(1, [3, 4, 5], 400))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await raw.call.read() is not grpc.aio.EOF:
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream 1 is already open" in info.value.details()
    await wait_until_kv_free(stack.scheduler_address)  # the open generation was cancelled with the call


async def test_cancelling_one_generation_aborts_it_and_leaves_the_others(stack):
    before = (await scheduler_stats(stack.scheduler_address)).num_aborted
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        raw = RawCall(channel)
        raw.send(start(1, [7, 8, 9], 30))
        raw.send(start(2, [7, 8, 10], 300))  # long enough to be running when cancelled
        assert (await raw.read()).events
        raw.send(generation_pb2.GenerateManyRequest(stream_id=2, cancel=True))
        events = await raw.until_ended([1])
        raw.half_close()
        while (response := await raw.read()) is not grpc.aio.EOF:  # whatever of 2 was already on its way
            assert all(e.stream_id == 2 for e in response.events)
    assert len(tokens_of(events[1])) == 30
    assert not any(e.response.finish_reason for e in events.get(2, []))
    await wait_until_kv_free(stack.scheduler_address)
    assert (await scheduler_stats(stack.scheduler_address)).num_aborted == before + 1


async def test_a_generation_past_its_deadline_ends_with_deadline_exceeded(stack):
    async with AsyncClient(stack.gateway_address) as client:
        with pytest.raises(DeadlineExceededError):
            await client.generate("slow", max_tokens=400, ignore_eos=True, timeout=0.05)
        # The call goes on serving the client's other streams.
        assert len((await client.generate("next", max_tokens=4, ignore_eos=True, timeout=60)).token_ids) == 4
    await wait_until_kv_free(stack.scheduler_address)


async def test_closing_the_client_cancels_its_open_generations(stack):
    before = (await scheduler_stats(stack.scheduler_address)).num_aborted
    client = AsyncClient(stack.gateway_address, timeout=60)
    stream = client.stream("endless", max_tokens=400, ignore_eos=True)
    await stream.__anext__()
    await client.close()
    await wait_until_kv_free(stack.scheduler_address)
    assert (await scheduler_stats(stack.scheduler_address)).num_aborted == before + 1


async def test_starts_past_max_concurrent_streams_wait_for_a_seat(stack, hf_tokenizer):
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig

    gateway = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=-1, redis_url=stack.redis_url,
                                         max_concurrent_streams=2), hf_tokenizer=hf_tokenizer)
    await gateway.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            raw = RawCall(channel)
            for sid in range(1, 6):
                raw.send(start(sid, [11, 12, sid], 12))
            events = await raw.until_ended(range(1, 6))
            raw.half_close()
    finally:
        await gateway.drain(grace_s=1)
    assert all(len(tokens_of(events[sid])) == 12 for sid in range(1, 6))
    order = [e for r in raw.responses for e in r.events]
    for sid in range(3, 6):  # each waited for one of the earlier ones to end
        first = next(i for i, e in enumerate(order) if e.stream_id == sid)
        finished_before = sum(1 for e in order[:first] if e.response.finish_reason)
        assert finished_before >= sid - 2


async def test_an_undecodable_message_fails_the_call_with_invalid_argument(stack):
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        method = channel.stream_stream("/pagedserve.v1.Generation/GenerateMany",
                                       request_serializer=lambda b: b, response_deserializer=lambda b: b)

        async def garbage():
            yield b"\xff\xff\xff\xff\x0f"  # a truncated varint

        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in method(garbage(), timeout=10):
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(info.value.trailing_metadata() or ()).get("pagedserve-field") == "request"


async def test_a_generation_whose_client_fell_behind_is_aborted(stack):
    """generate_to's emit raising SlowReaderError (GenerateMany's bound on the chunks waiting for a
    client) aborts the request, as a Generate stream's overflowing buffer does."""
    from gateway_service.messages import GenerateInput
    from gateway_service.output_fanout import SlowReaderError
    from servicekit.contract.sampling_params import SamplingParams

    before = (await scheduler_stats(stack.scheduler_address)).num_aborted
    sent = []

    def emit(chunk):
        if len(sent) == 3:
            raise SlowReaderError("the client fell 3 chunks behind")
        sent.append(chunk)

    inp = GenerateInput(SamplingParams(max_tokens=400, ignore_eos=True), prompt_token_ids=[31, 32, 33])
    with pytest.raises(SlowReaderError):
        await stack.gateway.service.generate_to(inp, emit)
    assert [c.first_index for c in sent] == [0, sum(len(c.token_ids) for c in sent[:1]),
                                             sum(len(c.token_ids) for c in sent[:2])]
    await wait_until_kv_free(stack.scheduler_address)
    assert (await scheduler_stats(stack.scheduler_address)).num_aborted == before + 1
    assert stack.gateway.service.in_flight == 0


class _Chatty:
    """A GenerationService stand-in whose generations emit 10 chunks at once (the writer gets no
    turn in between, as when a client stops reading and the call's writes stall)."""

    draining = False
    sampling_defaults: dict = {}

    async def wait_draining(self):
        await asyncio.Event().wait()

    async def generate_to(self, inp, emit, *, timeout_s=None, owner=""):
        from gateway_service.messages import GenerateChunk

        for i in range(10):
            emit(GenerateChunk(request_id="r", token_ids=[i], first_index=i))


async def test_each_generations_waiting_chunks_are_bounded():
    from gateway_service.multiplex import GenerateManyCall

    call = GenerateManyCall(_Chatty(), max_open=8, max_buffered=4)

    async def requests():
        yield start(1, [1, 2], 10)
        yield start(2, [1, 2], 10)

    events: dict[int, list] = {}
    async for response in call.responses(requests()):
        for event in response.events:
            events.setdefault(event.stream_id, []).append(event)
    for sid in (1, 2):  # four chunks each, then the cut
        assert [e.response.first_index for e in events[sid][:-1]] == [0, 1, 2, 3]
        assert events[sid][-1].error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "--max-buffered-outputs" in events[sid][-1].error_details


async def test_a_client_that_stops_reading_has_its_generations_cut_off_and_aborted(stack, hf_tokenizer):
    """Through a real call whose client reads nothing (a 1 KiB HTTP/2 window, so the gateway's
    writes stall): past --max-buffered-outputs chunks the requests are aborted without waiting for
    the client, which then gets what was sent and RESOURCE_EXHAUSTED."""
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig

    gateway = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=-1, redis_url=stack.redis_url,
                                         max_buffered_outputs=4), hf_tokenizer=hf_tokenizer)
    await gateway.start()
    before = (await scheduler_stats(stack.scheduler_address)).num_aborted
    try:
        options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}", options=options) as channel:
            raw = RawCall(channel)
            for sid in range(1, 5):
                msg = start(sid, [21, 22, sid], 400)
                msg.start.sampling_params.logprobs = 20  # big events: the window fills soon
                raw.send(msg)
            for _ in range(300):  # read nothing until the scheduler aborted them (at most 30 s)
                if (await scheduler_stats(stack.scheduler_address)).num_aborted >= before + 4:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("a call whose client reads nothing kept its generations running")
            events = await raw.until_ended(range(1, 5))
            raw.half_close()
    finally:
        await gateway.drain(grace_s=1)
    for sid in range(1, 5):
        *chunks, last = events[sid]
        assert last.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "--max-buffered-outputs" in last.error_details
        assert len(tokens_of(chunks)) < 400  # what was sent before the cut: in order, none repeated
