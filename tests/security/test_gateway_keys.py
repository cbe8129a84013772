"""API keys at the gateway (over TLS): no key, a wrong key or a revoked key is UNAUTHENTICATED on
every Generation method; the right key works; health and reflection stay open; a request belongs
to the key that admitted it; per-key concurrency is limited. Real certificates (trustme), real
gRPC over loopback, real Redis."""

from __future__ import annotations

import asyncio
import os
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedserve import wire
from pagedserve.aio_client import AsyncClient
from pagedserve.errors import AlreadyExistsError, ResourceExhaustedError, UnauthenticatedError
from servicekit.auth import bearer_metadata
from servicekit.proto.pb import generation_pb2, generation_pb2_grpc
from servicekit.tls import aio_channel

from .conftest import KEYS, MAX_REQUESTS_PER_KEY

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "The quick brown fox"


def client(stack, pki, key: str | None) -> AsyncClient:
    return AsyncClient(stack.gateway_address, api_key=key or "", tls=pki.client, timeout=60, retries=0)


async def call_each_method(stack, pki, metadata) -> dict[str, grpc.StatusCode]:
    """The status of Generate, Tokenize and ModelInfo called with ``metadata``."""
    codes = {}
    async with aio_channel(stack.gateway_address, pki.client, []) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = {
            "Generate": lambda: _drain(stub.Generate(generation_pb2.GenerateRequest(prompt=PROMPT), timeout=30,
                                                     metadata=metadata)),
            "Tokenize": lambda: stub.Tokenize(generation_pb2.TokenizeRequest(text=PROMPT), timeout=30,
                                              metadata=metadata),
            "ModelInfo": lambda: stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=30, metadata=metadata),
        }
        for name, call in calls.items():
            try:
                await call()
                codes[name] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                codes[name] = exc.code()
    return codes


async def _drain(call) -> None:
    async for _ in call:
        pass


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer not-a-key"),),
                                      (("authorization", KEYS["alice"]),),  # no "Bearer " scheme
                                      (("authorization", "Basic " + KEYS["alice"]),)],
                         ids=["no-key", "wrong-key", "no-scheme", "basic-scheme"])
async def test_calls_without_a_valid_key_are_unauthenticated(secure_stack, pki, metadata):
    codes = await call_each_method(secure_stack, pki, metadata)
    assert codes == dict.fromkeys(codes, grpc.StatusCode.UNAUTHENTICATED)


async def test_the_right_key_works_on_every_method(secure_stack, pki):
    codes = await call_each_method(secure_stack, pki, bearer_metadata(KEYS["bob"]))
    assert codes == dict.fromkeys(codes, grpc.StatusCode.OK)
    async with client(secure_stack, pki, KEYS["alice"]) as sdk:
        completion = await sdk.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert len(completion.token_ids) == 8


async def test_the_sdk_raises_unauthenticated_without_a_key(secure_stack, pki, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    async with client(secure_stack, pki, None) as sdk:
        with pytest.raises(UnauthenticatedError):
            await sdk.generate(PROMPT, max_tokens=4)
    monkeypatch.setenv("PAGEDSERVE_API_KEY", KEYS["bob"])  # the SDK's default key
    async with AsyncClient(secure_stack.gateway_address, tls=pki.client, timeout=60) as sdk:
        assert (await sdk.generate(PROMPT, max_tokens=4, ignore_eos=True)).token_ids


async def test_health_and_reflection_stay_open_without_a_key(secure_stack, pki):
    async with aio_channel(secure_stack.gateway_address, pki.client, []) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = [s.name async for r in call for s in r.list_services_response.service]
    assert "pagedserve.v1.Generation" in names


async def test_a_plaintext_client_cannot_talk_to_the_tls_gateway(secure_stack):
    async with aio_channel(secure_stack.gateway_address, None, []) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_revoked_key_is_refused_once_the_key_file_changes(secure_stack, pki):
    async with client(secure_stack, pki, KEYS["carol"]) as sdk:
        assert (await sdk.generate(PROMPT, max_tokens=2, ignore_eos=True)).token_ids
        original = secure_stack.keys_file.read_text()
        try:
            secure_stack.keys_file.write_text(original.replace(KEYS["carol"] + "\n", ""))
            stat = os.stat(secure_stack.keys_file)  # a new mtime even on a coarse-grained file system
            os.utime(secure_stack.keys_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
            for _ in range(100):  # the file is checked at most once a second
                try:
                    await sdk.generate(PROMPT, max_tokens=1, ignore_eos=True)
                except UnauthenticatedError:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the revoked key still works 10 s after the key file changed")
        finally:
            secure_stack.keys_file.write_text(original)
    async with client(secure_stack, pki, KEYS["alice"]) as sdk:  # the other keys never stopped working
        assert (await sdk.generate(PROMPT, max_tokens=2, ignore_eos=True)).token_ids


async def test_only_the_admitting_key_may_resume_a_request(secure_stack, pki):
    request_id = uuid.uuid4().hex
    async with client(secure_stack, pki, KEYS["alice"]) as alice:
        first = await alice.generate(PROMPT, request_id=request_id, max_tokens=6, temperature=0, ignore_eos=True)
    request = wire.build_generate_request(PROMPT, request_id=request_id, max_tokens=6, temperature=0,
                                          ignore_eos=True)
    request.resume_from_index = 0

    async def resume(key: str) -> list[int]:
        async with aio_channel(secure_stack.gateway_address, pki.client, []) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return [t async for r in stub.Generate(request, timeout=30, metadata=bearer_metadata(key))
                    for t in r.token_ids]

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await resume(KEYS["bob"])  # same id, same input, another key: as if the id did not exist
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert await resume(KEYS["alice"]) == list(first.token_ids)
    async with client(secure_stack, pki, KEYS["bob"]) as bob:  # nor can bob take the id over
        with pytest.raises(AlreadyExistsError) as taken:
            await bob.generate(PROMPT, request_id=request_id, max_tokens=2)
        assert isinstance(taken.value, AlreadyExistsError)


async def test_server_chosen_request_ids_carry_122_random_bits(secure_stack, pki):
    async with aio_channel(secure_stack.gateway_address, pki.client, []) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = wire.build_generate_request(PROMPT, max_tokens=1, ignore_eos=True)
        ids = {r.request_id async for r in stub.Generate(request, timeout=30, metadata=bearer_metadata(KEYS["bob"]))}
    (request_id,) = ids
    assert uuid.UUID(hex=request_id).version == 4  # uuid4: 122 of its 128 bits are random


async def test_one_key_may_hold_at_most_its_limit_of_streams(secure_stack, pki):
    async with client(secure_stack, pki, KEYS["alice"]) as alice, client(secure_stack, pki, KEYS["bob"]) as bob:
        streams = [alice.stream(PROMPT, max_tokens=400, ignore_eos=True) for _ in range(MAX_REQUESTS_PER_KEY)]
        try:
            for s in streams:
                await s.__anext__()  # admitted and generating
            with pytest.raises(ResourceExhaustedError):
                await alice.generate(PROMPT, max_tokens=1)
            assert (await bob.generate(PROMPT, max_tokens=1, ignore_eos=True)).token_ids  # other keys unaffected
        finally:
            for s in streams:
                await s.aclose()
        for _ in range(100):  # the slots come back as the cancelled calls end
            try:
                assert (await alice.generate(PROMPT, max_tokens=1, ignore_eos=True)).token_ids
                break
            except ResourceExhaustedError:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("the key's slots did not come back after its streams closed")


def _https(url: str, ca_file: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of one HTTPS call that trusts ``ca_file``."""
    import json
    import ssl
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=ca_file), timeout=30) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


async def test_the_http_api_takes_the_same_keys_over_tls(secure_stack, pki):
    """The OpenAI API's front door: HTTPS with the gateway's certificate, the same API keys."""
    base = f"https://localhost:{secure_stack.gateway.http_port}"
    body = {"model": secure_stack.model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    statuses = {}
    for name, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer nope"}),
                          ("basic", {"Authorization": f"Basic {KEYS['alice']}"})):
        status, reply = await asyncio.to_thread(_https, f"{base}/v1/completions", pki.ca, body, headers)
        statuses[name] = (status, reply["error"]["type"])
    models, _ = await asyncio.to_thread(_https, f"{base}/v1/models", pki.ca)
    health, _ = await asyncio.to_thread(_https, f"{base}/health", pki.ca)
    ok, reply = await asyncio.to_thread(_https, f"{base}/v1/completions", pki.ca, body,
                                        {"Authorization": f"Bearer {KEYS['bob']}"})

    print(f"HTTP without a valid key: {statuses}")
    assert all(status == (401, "AuthenticationError") for status in statuses.values())
    assert models == 401 and health == 200  # health stays open
    assert ok == 200 and reply["usage"]["completion_tokens"] == 2
