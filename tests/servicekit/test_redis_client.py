"""servicekit.redis_client: every service reaches Redis through one function, from one URL or
through Sentinels, with the URL's credentials and TLS carried over; the Sentinel settings are
flags and env vars of all three services; the gateway waits for a replica by default only with
Sentinels. (The failover itself, with real processes: tests/chaos/test_redis_failover.py.)"""

from __future__ import annotations

import pytest

from gateway_service.config import GatewayConfig
from servicekit import redis_client

SENTINELS = ("10.0.0.1:26379", "sentinel-b:26380")


def test_one_url_makes_a_plain_client():
    from redis.asyncio.sentinel import SentinelConnectionPool

    client = redis_client.connect(GatewayConfig(redis_url="redis://127.0.0.1:7001/3"))
    kwargs = client.connection_pool.connection_kwargs
    assert not isinstance(client.connection_pool, SentinelConnectionPool)
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("127.0.0.1", 7001, 3)


def test_sentinels_name_the_primary_and_the_url_gives_credentials_database_and_tls():
    from redis.asyncio.sentinel import SentinelConnectionPool, SentinelManagedSSLConnection

    settings = GatewayConfig(redis_url="rediss://app:secret@ignored:1/2", redis_sentinels=SENTINELS,
                               redis_master_name="main", redis_sentinel_password="s-pass")
    client = redis_client.connect(settings)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "main"
    assert issubclass(pool.connection_class, SentinelManagedSSLConnection)
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
        GatewayConfig(redis_sentinels=bad)


def test_a_master_name_is_required_with_sentinels():
    with pytest.raises(ValueError, match="redis_master_name"):
        GatewayConfig(redis_sentinels=SENTINELS, redis_master_name="")


def test_ipv6_sentinel_addresses_keep_their_colons():
    assert redis_client.parse_address("[::1]:26379") == ("::1", 26379)


@pytest.mark.parametrize("mode, sentinels, waits_ms", [
    ("auto", (), 0), ("auto", SENTINELS, 1000), ("on", (), 1000), ("off", SENTINELS, 0)])
def test_admissions_wait_for_a_replica_by_default_only_with_sentinels(mode, sentinels, waits_ms):
    settings = GatewayConfig(wait_for_replica=mode, redis_sentinels=sentinels)
    assert settings.admission_replica_wait_ms == waits_ms


async def test_more_concurrent_commands_than_connections_wait_for_one_instead_of_failing(redis_server, monkeypatch):
    """A burst bigger than the pool (a few hundred admissions at one gateway) queues for a
    connection; redis-py's default pool refused past 100 with MaxConnectionsError (a 503)."""
    import asyncio

    monkeypatch.setattr(redis_client, "MAX_CONNECTIONS", 8)
    client = redis_client.connect(GatewayConfig(redis_url=redis_server.url))
    try:
        # BLPOP holds its connection for its whole timeout: 40 of them need 5 rounds of 8.
        replies = await asyncio.gather(*(client.blpop([f"empty:{i}"], timeout=0.1) for i in range(40)))
        assert replies == [None] * 40
        assert client.connection_pool.max_connections == 8
        assert len(client.connection_pool._available_connections) <= 8
    finally:
        await client.aclose()


@pytest.mark.parametrize("url, base", [("redis://127.0.0.1:7001/0", "Connection"), ("rediss://h:1/0", "SSLConnection"),
                                       ("unix:///tmp/redis.sock", "UnixDomainSocketConnection")])
def test_commands_are_packed_in_c_to_the_same_bytes_as_redis_py(url, base):
    """The services' connections pack with hiredis (130 arguments a step: a sixth of the CPU of
    redis-py's Python packer); the bytes are redis-py's for every kind of argument, and a value
    Redis cannot take is refused with redis-py's error."""
    import redis.asyncio.connection as rc
    from redis.exceptions import DataError

    pool = redis_client.connect(GatewayConfig(redis_url=url)).connection_pool
    plain_class = getattr(rc, base)
    assert issubclass(pool.connection_class, plain_class) and pool.connection_class is not plain_class
    fast, plain = pool.make_connection(), plain_class(**pool.connection_kwargs)
    for args in [("XREAD", "COUNT", 256, "BLOCK", 1000, "STREAMS", "ps:out:a", b"ps:out:\xff", "0-0", "17-1"),
                 ("SET", "k", 1.5), ("SET", "k", 10**20), ("SET", "k", -3), ("SET", "k", "h\u00e9llo"),
                 ("SET", "k", memoryview(b"abc")), ("SET", "k", b""), ("CONFIG GET", "maxmemory"),
                 (b"CLIENT SETNAME", b"x"), ("EVALSHA", "f" * 40, 1, "key", b"\x00" * 70_000)]:
        assert b"".join(fast.pack_command(*args)) == b"".join(map(bytes, plain.pack_command(*args))), args
    assert fast.pack_commands([("SET", "a", 1), ("GET", "a")]) == plain.pack_commands([("SET", "a", 1), ("GET", "a")])
    for bad in (None, True, [1]):
        with pytest.raises(DataError):
            fast.pack_command("SET", "k", bad)


async def test_a_client_with_c_packing_round_trips_every_kind_of_value(redis_server):
    client = redis_client.connect(GatewayConfig(redis_url=redis_server.url))
    try:
        values = {"bytes": b"\x00\xff", "text": "h\u00e9llo", "int": 7, "float": 0.1 + 0.2}
        await client.mset(values)
        assert await client.mget(list(values)) == [b"\x00\xff", "h\u00e9llo".encode(), b"7", b"0.30000000000000004"]
        await client.xadd("s", {"data": b"\x01" * 100_000})
        [(_key, [(_id, fields)])] = await client.xread({"s": "0-0"})
        assert fields == {b"data": b"\x01" * 100_000}
    finally:
        await client.aclose()
