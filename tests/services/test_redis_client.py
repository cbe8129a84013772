"""servicekit.redis_client: every service reaches Redis through one function, from one URL or
through Sentinels, with the URL's credentials and TLS carried over; the Sentinel settings are
flags and env vars of all three services; the gateway waits for a replica by default only with
Sentinels. (The failover itself, with real processes: tests/chaos/test_redis_failover.py.)"""

from __future__ import annotations

import pytest

from gateway_service.settings import GatewaySettings
from servicekit import redis_client

SENTINELS = ("10.0.0.1:26379", "sentinel-b:26380")


def test_one_url_makes_a_plain_client():
    from redis.asyncio.sentinel import SentinelConnectionPool

    client = redis_client.connect(GatewaySettings(redis_url="redis://127.0.0.1:7001/3"))
    kwargs = client.connection_pool.connection_kwargs
    assert not isinstance(client.connection_pool, SentinelConnectionPool)
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("127.0.0.1", 7001, 3)


def test_sentinels_name_the_primary_and_the_url_gives_credentials_database_and_tls():
    from redis.asyncio.sentinel import SentinelConnectionPool, SentinelManagedSSLConnection

    settings = GatewaySettings(redis_url="rediss://app:secret@ignored:1/2", redis_sentinels=SENTINELS,
                               redis_master_name="main", redis_sentinel_password="s-pass")
    client = redis_client.connect(settings)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "main"
    assert pool.connection_class is SentinelManagedSSLConnection
    kwargs = pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("app", "secret", 2)
    assert "host" not in kwargs  # the Sentinels say where the primary is
    sentinels = pool.sentinel_manager.sentinels
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels] == [("10.0.0.1", 26379), ("sentinel-b", 26380)]
    assert all(s.connection_pool.connection_kwargs["password"] == "s-pass" for s in sentinels)


@pytest.mark.parametrize("service", ["gateway_service.main", "scheduler_service.main", "worker_service.main"])
def test_every_service_takes_sentinels_from_flags_and_env(service):
    import importlib

    module = importlib.import_module(service)
    env = {"PAGEDSERVE_REDIS_MASTER_NAME": "from-env"}
    settings = module.settings_from_args(module.build_parser(env).parse_args(["--redis-sentinels", ",".join(SENTINELS)]))
    assert settings.redis_sentinels == SENTINELS
    assert settings.redis_master_name == "from-env"
    assert redis_client.uses_redis(settings)


@pytest.mark.parametrize("bad", [("no-port",), ("host:0",), ("host:http",), (":26379",)])
def test_a_sentinel_address_without_host_and_port_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="redis_sentinels"):
        GatewaySettings(redis_sentinels=bad)


def test_a_master_name_is_required_with_sentinels():
    with pytest.raises(ValueError, match="redis_master_name"):
        GatewaySettings(redis_sentinels=SENTINELS, redis_master_name="")


def test_ipv6_sentinel_addresses_keep_their_colons():
    assert redis_client.parse_address("[::1]:26379") == ("::1", 26379)


@pytest.mark.parametrize("mode, sentinels, waits_ms", [
    ("auto", (), 0), ("auto", SENTINELS, 1000), ("on", (), 1000), ("off", SENTINELS, 0)])
def test_admissions_wait_for_a_replica_by_default_only_with_sentinels(mode, sentinels, waits_ms):
    settings = GatewaySettings(wait_for_replica=mode, redis_sentinels=sentinels)
    assert settings.admission_replica_wait_ms == waits_ms


async def test_more_concurrent_commands_than_connections_wait_for_one_instead_of_failing(redis_server, monkeypatch):
    """A burst bigger than the pool (a few hundred admissions at one gateway) queues for a
    connection; redis-py's default pool refused past 100 with MaxConnectionsError (a 503)."""
    import asyncio

    monkeypatch.setattr(redis_client, "MAX_CONNECTIONS", 8)
    client = redis_client.connect(GatewaySettings(redis_url=redis_server.url))
    try:
        # BLPOP holds its connection for its whole timeout: 40 of them need 5 rounds of 8.
        replies = await asyncio.gather(*(client.blpop([f"empty:{i}"], timeout=0.1) for i in range(40)))
        assert replies == [None] * 40
        assert client.connection_pool.max_connections == 8
        assert len(client.connection_pool._available_connections) <= 8
    finally:
        await client.aclose()
