"""Redis that survives losing its primary: a primary + a replica + three Sentinels as processes,
the services reaching Redis through the Sentinels (``--redis-sentinels``).

- rewind the consumer group's delivery cursor while 16 greedy streams are mid-generation (what a
  failover does when the replica lacked the last deliveries): requests delivered again are not
  run twice by the scheduler holding them, and run by another scheduler give the same tokens;
- kill -9 the primary while 16 greedy streams are mid-generation: the Sentinels promote the
  replica, every service reconnects to it, every stream completes with each output index once and
  the tokens of a run without faults, and every worker's block pool returns to all free;
- admissions are durable before the gateway acknowledges them: with a replica present, ``admit``
  returns once the replica holds the request (``WAIT 1``); a replica that cannot answer is waited
  for no longer than the timeout and counted.
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import redis

from gateway_service.admission import Admission, RequestDigests
from pagedserve.local_cluster import LocalCluster
from servicekit import redis_client
from servicekit.contract.sampling_params import SamplingParams
from servicekit.redis_layout import SCHEDULER_GROUP, RedisKeys

from .conftest import PREFIX, redis_server_binary, start_cluster, wait_for_async
from .streams import assert_exactly_the_fault_free_outputs, assert_surviving_pools_all_free, streams_with_a_fault

pytestmark = [pytest.mark.chaos, pytest.mark.service, pytest.mark.slow, pytest.mark.asyncio]

NUM_STREAMS = 16
MAX_TOKENS = 96
PROMPTS = [f"Stream {i}: the harbour master wrote down every ship" for i in range(NUM_STREAMS)]
DIGESTS = RequestDigests(prompt="p", params="s")


@pytest.fixture(scope="module")
def expected(llm) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outputs]


def replica_of(stack: LocalCluster):
    return next(p for p in stack.live("redis") if p is not stack.redis)


@pytest.fixture(scope="module")
def ha_stack(tiny_model_dir, tmp_path_factory):
    """Primary + replica + 3 Sentinels, 2 workers, 2 schedulers, 2 gateways, for the module."""
    cluster = start_cluster(tmp_path_factory.mktemp("redis-ha"), tiny_model_dir, num_workers=2, num_schedulers=2,
                            num_gateways=2, redis_ha=True)
    try:
        yield cluster
    finally:
        cluster.stop()


async def test_requests_delivered_again_after_a_failover_run_once_more_with_the_same_tokens(ha_stack, expected):
    """What a failover does to the consumer group when the replica had the request entries but not
    their latest deliveries (replication is asynchronous): the group's delivery cursor goes back,
    and the schedulers pull requests they (or the other one) already run."""
    stack = ha_stack
    gateways = [g.address for g in stack.live("gateway")]

    async def rewind_the_group() -> None:
        with redis.Redis(port=stack.primary_port()) as primary:
            primary.xgroup_setid(PREFIX + "requests", SCHEDULER_GROUP, "0")

    logs = await streams_with_a_fault(gateways, PROMPTS, MAX_TOKENS, rewind_the_group)
    assert_exactly_the_fault_free_outputs(logs, expected, MAX_TOKENS)
    await assert_surviving_pools_all_free(stack)


async def test_kill_the_redis_primary_mid_generation(ha_stack, expected):
    stack = ha_stack
    replica = replica_of(stack)
    gateways = [g.address for g in stack.live("gateway")]

    async def kill_primary() -> None:
        assert stack.primary_port() == stack.redis.port
        stack.kill(stack.redis)

    logs = await streams_with_a_fault(gateways, PROMPTS, MAX_TOKENS, kill_primary)
    assert stack.primary_port() == replica.port  # promoted by the Sentinels, not restarted
    assert_exactly_the_fault_free_outputs(logs, expected, MAX_TOKENS)
    await assert_surviving_pools_all_free(stack)
    # Every service carried on against the promoted replica: nothing but it is left to serve from.
    assert {p.kind for p in stack.procs if not p.alive} == {"redis"}
    with redis.Redis(port=replica.port) as client:
        assert client.info("replication")["role"] == "master"


@pytest.fixture
def redis_ha(tmp_path):
    """A primary + one replica + three Sentinels, no services."""
    redis_server_binary()  # skips when there is none
    cluster = LocalCluster(tmp_path)
    try:
        cluster.start_redis_ha(num_replicas=1, num_sentinels=3)
        yield cluster
    finally:
        cluster.stop()


def through_sentinels(cluster: LocalCluster):
    settings = SimpleNamespace(redis_url="redis://ignored:1/0", redis_sentinels=tuple(cluster.sentinel_addresses.split(",")),
                               redis_master_name=cluster.master_name, redis_sentinel_password="")
    return redis_client.connect(settings)


async def test_an_admission_is_on_the_replica_when_admit_returns(redis_ha):
    keys = RedisKeys("ha:")
    client = through_sentinels(redis_ha)
    try:
        admission = Admission(client, keys, max_queued=0, output_ttl_s=60, replica_wait_ms=10_000)
        for i in range(20):
            await admission.admit(f"r{i}", b"record", DIGESTS, keys.gateway_wake("g"), "", keys.gateway_live("g"))
        assert (admission.num_replicated, admission.num_unreplicated) == (20, 0)
        with redis.Redis(port=replica_of(redis_ha).port) as replica:
            assert replica.xlen(keys.requests) == 20  # read at once: WAIT made it so
            assert replica.exists(keys.output("r19"))
    finally:
        await client.aclose()


async def test_an_unresponsive_replica_delays_an_admission_only_until_the_timeout(redis_ha):
    keys = RedisKeys("ha:")
    client = through_sentinels(redis_ha)
    replica = replica_of(redis_ha)
    try:
        admission = Admission(client, keys, max_queued=0, output_ttl_s=60, replica_wait_ms=200)
        await admission.admit("before", b"record", DIGESTS, keys.gateway_wake("g"), "", keys.gateway_live("g"))
        assert admission.num_replicated == 1
        os.killpg(replica.popen.pid, signal.SIGSTOP)  # connected but silent: WAIT gets no answer
        try:
            await admission.admit("frozen", b"record", DIGESTS, keys.gateway_wake("g"), "", keys.gateway_live("g"))
        finally:
            os.killpg(replica.popen.pid, signal.SIGCONT)
        assert (admission.num_replicated, admission.num_unreplicated) == (1, 1)
        assert await client.exists(keys.output("frozen"))  # admitted all the same

        async def caught_up() -> bool:
            with redis.Redis(port=replica.port) as r:
                return r.xlen(keys.requests) == 2

        await wait_for_async(caught_up, 30, "the thawed replica has both admissions")
    finally:
        await client.aclose()


async def test_no_wait_without_replicas_or_when_off(tmp_path):
    redis_server_binary()
    cluster = LocalCluster(tmp_path)
    cluster.start_redis()
    client = redis_client.connect(SimpleNamespace(redis_url=cluster.redis_url, redis_sentinels=(),
                                                  redis_master_name="", redis_sentinel_password=""))
    keys = RedisKeys("solo:")
    try:
        alone = Admission(client, keys, max_queued=0, output_ttl_s=60, replica_wait_ms=60_000)
        # would block a minute if it WAITed
        await alone.admit("a", b"record", DIGESTS, keys.gateway_wake("g"), "", keys.gateway_live("g"))
        off = Admission(client, keys, max_queued=0, output_ttl_s=60)
        await off.admit("b", b"record", DIGESTS, keys.gateway_wake("g"), "", keys.gateway_live("g"))
        assert (alone.num_replicated, alone.num_unreplicated, off.num_replicated) == (0, 0, 0)
        assert await client.xlen(keys.requests) == 2
    finally:
        await client.aclose()
        cluster.stop()
