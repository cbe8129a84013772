"""The chaos stack with security on: every link TLS (scheduler -> worker mutual TLS, the schedulers'
admin servers too), gateways that want API keys. kill -9 the gateway the SDK streams through and
the busiest worker while seeded and greedy streams are mid-generation: every stream completes on
the other gateway with each output index once and the tokens of a run without faults, and the
request stays its admitting key's — another key cannot read it on the surviving gateway, though
the gateway that checked the key at admission is gone.
"""

from __future__ import annotations

import uuid

import grpc
import pytest
from security.conftest import pki  # noqa: F401  (fixture: the CA and certificates made at test time)

from pagedserve import wire
from pagedserve.local_cluster import LocalCluster
from servicekit.auth import bearer_metadata
from servicekit.contract.sampling_params import SamplingParams
from servicekit.proto.pb import generation_pb2_grpc
from servicekit.tls import TlsFiles, aio_channel

from .conftest import start_cluster
from .streams import assert_exactly_the_fault_free_outputs, assert_surviving_pools_all_free, busiest_worker
from .streams import streams_with_a_fault

pytestmark = [pytest.mark.chaos, pytest.mark.service, pytest.mark.slow, pytest.mark.asyncio]

KEYS = {"alice": "key-alice-chaos-0123456789", "bob": "key-bob-chaos-9876543210"}
NUM_STREAMS = 12
MAX_TOKENS = 96
PROMPTS = [f"Secure stream {i}: the ferry crossed the bay at dawn" for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def secure_cluster(tiny_model_dir, tmp_path_factory, pki):  # noqa: F811
    """2 workers + 2 schedulers + 2 gateways, all presenting the security tests' certificate for
    127.0.0.1 (``pki.worker``: a server and client certificate of their CA)."""
    keys_file = tmp_path_factory.mktemp("secure-chaos-keys") / "api-keys.txt"
    keys_file.write_text("\n".join(KEYS.values()) + "\n")
    cluster = start_cluster(tmp_path_factory.mktemp("secure-chaos"), tiny_model_dir, num_workers=2, num_schedulers=2,
                            num_gateways=2, tls=pki.worker, gateway_args=("--api-keys-file", str(keys_file)))
    try:
        for proc in cluster.procs:  # each service's start-up line says how its links are protected
            assert proc.kind == "redis" or "mutual TLS" in proc.tail() or "TLS, 2 API keys" in proc.tail(), proc.name
        yield cluster
    finally:
        cluster.stop()


async def test_streams_over_tls_survive_their_gateway_and_the_busiest_worker_killed(secure_cluster: LocalCluster,
                                                                                    llm):
    stack = secure_cluster
    first, second = stack.live("gateway")
    per_stream = [dict(temperature=0.9, top_p=0.9, seed=300 + i) if i % 2 else dict(temperature=0)
                  for i in range(NUM_STREAMS)]
    expected = [o.token_ids for o in llm.generate(PROMPTS, [
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs) for kwargs in per_stream])]
    for kwargs in per_stream:
        kwargs["request_id"] = uuid.uuid4().hex
    client_tls = TlsFiles(ca_file=stack.tls.ca_file)  # an SDK user: verifies the gateway, no certificate

    async def kill_the_gateway_and_the_busiest_worker() -> None:
        victim = await busiest_worker(stack)
        stack.kill(first)
        stack.kill(victim)

    logs = await streams_with_a_fault([first.address, second.address], PROMPTS, MAX_TOKENS,
                                      kill_the_gateway_and_the_busiest_worker, per_stream=per_stream,
                                      client_options={"api_key": KEYS["alice"], "tls": client_tls})
    assert_exactly_the_fault_free_outputs(logs, expected, MAX_TOKENS)
    await assert_surviving_pools_all_free(stack)

    # The first request was admitted by the dead gateway under alice's key; on the other gateway
    # bob's key cannot read it (as if it did not exist), alice's reads what she got.
    request = wire.build_generate_request(PROMPTS[0], max_tokens=MAX_TOKENS, ignore_eos=True, **per_stream[0])
    request.resume_from_index = 0

    async def read(key: str) -> list[int]:
        async with aio_channel(second.address, client_tls, []) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return [t async for r in stub.Generate(request, timeout=30, metadata=bearer_metadata(key))
                    for t in r.token_ids]

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await read(KEYS["bob"])
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert await read(KEYS["alice"]) == expected[0]
