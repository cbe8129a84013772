"""Fuzzing the gateway's Generate: random requests — random unicode, extreme and non-finite
numbers, huge lists, token ids at and past the vocabulary, bad chat turns, odd request ids and
resume indices, and raw bytes that are no GenerateRequest at all — are answered either with a
stream (a valid request) or with a client-error status; never INTERNAL or UNKNOWN; and the stack
keeps serving. Hundreds of cases by default; ``PAGEDSERVE_FUZZ_EXAMPLES=5000`` for more.

Each valid request is cancelled after its first answer (the gateway aborts it), so a case costs
one admission, not a generation."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servicekit.auth import bearer_metadata
from servicekit.proto.pb import generation_pb2, sampling_pb2
from servicekit.tls import sync_channel

from .conftest import KEYS

pytestmark = pytest.mark.asyncio(loop_scope="session")

EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "300"))
# The client-error family: what a bad request may get. OK: a valid request started streaming.
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
           grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION}
# Transport-level texts: an error the client's gRPC library made up, not the gateway's answer.
TRANSPORT_TEXTS = ("Stream removed", "exceeds hard limit", "Received message larger than max")
VOCAB_EDGE = 49152  # SmolLM2's vocabulary size: ids around it probe the bound

INT32 = st.one_of(st.integers(-2**31, 2**31 - 1), st.sampled_from([0, 1, -1, 2**31 - 1, -2**31]))
DOUBLE = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e308, -1e-308]))
UINT32 = st.one_of(st.integers(0, 2**32 - 1), st.integers(VOCAB_EDGE - 2, VOCAB_EDGE + 2), st.integers(0, 200))
# Any encodable text (protobuf strings are UTF-8: invalid bytes on the wire are RAW_BYTES' part).
UNICODE = st.characters(codec="utf-8")
TEXT = st.one_of(st.text(UNICODE, max_size=64), st.text(st.characters(min_codepoint=0x80, codec="utf-8"), max_size=32),
                 st.just(""), st.just("x" * 20_000))


def _optional(strategy):
    return st.one_of(st.none(), strategy)


@st.composite
def sampling_params(draw) -> sampling_pb2.SamplingParams:
    fields = dict(
        max_tokens=draw(_optional(st.one_of(INT32, st.integers(1, 8)))),
        min_tokens=draw(_optional(INT32)), temperature=draw(_optional(DOUBLE)), top_k=draw(_optional(INT32)),
        top_p=draw(_optional(DOUBLE)), min_p=draw(_optional(DOUBLE)),
        seed=draw(_optional(st.integers(0, 2**64 - 1))), ignore_eos=draw(_optional(st.booleans())),
        repetition_penalty=draw(_optional(DOUBLE)), presence_penalty=draw(_optional(DOUBLE)),
        frequency_penalty=draw(_optional(DOUBLE)), logprobs=draw(_optional(INT32)))
    params = sampling_pb2.SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    params.stop.extend(draw(st.lists(TEXT, max_size=draw(st.sampled_from([3, 100])))))
    params.stop_token_ids.extend(draw(st.lists(UINT32, max_size=draw(st.sampled_from([3, 5000])))))
    return params


@st.composite
def generate_requests(draw) -> bytes:
    request = generation_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["prompt", "chat", "ids", "none"]))
    if kind == "prompt":
        request.prompt = draw(TEXT)
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(st.one_of(st.sampled_from(["system", "user", "assistant"]),
                                                                 TEXT), TEXT), max_size=6)):
            request.chat.messages.add(role=role, content=content)
        if not request.chat.messages:
            request.chat.SetInParent()
    elif kind == "ids":
        request.prompt_token_ids.ids.extend(draw(st.lists(UINT32, max_size=draw(st.sampled_from([8, 600, 70_000])))))
        if not request.prompt_token_ids.ids:
            request.prompt_token_ids.SetInParent()
    if draw(st.booleans()):
        request.sampling_params.CopyFrom(draw(sampling_params()))
    request.model = draw(st.one_of(st.just(""), TEXT))
    request.request_id = draw(st.one_of(st.just(""), TEXT, st.from_regex(r"[A-Za-z0-9._:-]{1,130}", fullmatch=True)))
    if draw(st.booleans()):
        request.resume_from_index = draw(UINT32)
    request.priority = draw(INT32)
    request.cache_salt = draw(st.one_of(st.just(""), TEXT))
    request.include_special_tokens = draw(st.booleans())
    return request.SerializeToString()


@st.composite
def plausible_requests(draw) -> bytes:
    """Mostly valid requests with random text and small edits: the paths past validation (admission,
    streaming, cancellation) get fuzzed too, not only the refusals."""
    request = generation_pb2.GenerateRequest(prompt=draw(st.text(UNICODE, min_size=1, max_size=40)))
    request.sampling_params.max_tokens = draw(st.integers(1, 4))
    request.sampling_params.temperature = draw(st.floats(0, 2))
    request.sampling_params.stop.extend(draw(st.lists(st.text(UNICODE, min_size=1, max_size=8), max_size=3)))
    if draw(st.booleans()):
        request.sampling_params.logprobs = draw(st.integers(0, 30))
    if draw(st.booleans()):
        request.sampling_params.seed = draw(st.integers(0, 2**64 - 1))
    request.include_special_tokens = draw(st.booleans())
    return request.SerializeToString()


RAW_BYTES = st.one_of(st.binary(max_size=256), st.binary(min_size=1, max_size=64).map(lambda b: b"\x12" + b))


def _status_of(channel: grpc.Channel, payload: bytes) -> tuple[grpc.StatusCode, str]:
    """The first answer's status: OK when a chunk came (the call is then cancelled)."""
    generate = channel.unary_stream("/pagedserve.v1.Generation/Generate", request_serializer=None,
                                    response_deserializer=generation_pb2.GenerateResponse.FromString)
    call = generate(payload, timeout=60, metadata=bearer_metadata(KEYS["bob"]))
    try:
        next(call)
        return grpc.StatusCode.OK, ""
    except StopIteration:
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    finally:
        call.cancel()


def _fuzz(address: str, tls) -> list[tuple[grpc.StatusCode, str]]:
    seen: list[tuple[grpc.StatusCode, str]] = []
    with sync_channel(address, tls) as channel:
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
        @given(payload=st.one_of(generate_requests(), plausible_requests(), RAW_BYTES))
        def case(payload: bytes) -> None:
            code, details = _status_of(channel, payload)
            seen.append((code, details))
            assert code in ALLOWED, f"{code.name}: {details}"
            assert not any(t in details for t in TRANSPORT_TEXTS), f"{code.name}: {details[:300]}"

        case()
    return seen


async def test_random_generate_requests_get_client_errors_never_internal(secure_stack, pki):
    from pagedserve.aio_client import AsyncClient

    seen = await asyncio.to_thread(_fuzz, secure_stack.gateway_address, pki.client)
    codes = {code for code, _ in seen}
    print(f"fuzz: {len(seen)} requests; statuses: " + ", ".join(
        f"{c.name}={sum(1 for s, _ in seen if s == c)}" for c in sorted(codes, key=lambda c: c.value[0])))
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= codes
    async with AsyncClient(secure_stack.gateway_address, api_key=KEYS["alice"], tls=pki.client, timeout=60) as sdk:
        completion = await sdk.generate("Still serving?", max_tokens=4, ignore_eos=True)  # the stack keeps serving
    assert len(completion.token_ids) == 4
