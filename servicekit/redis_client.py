"""How every service reaches Redis: one function, :func:`connect`, from the service's settings.

Two ways, chosen by the settings:

- ``redis_url`` alone: one Redis server (``redis://[user:password@]host:port/db``; ``rediss://``
  for TLS, with redis-py's ``ssl_*`` query options).
- ``redis_sentinels`` (``host:port,...``) + ``redis_master_name``: the primary is whatever the
  Sentinels say it is. Every new connection asks them for its address, and a connection to a
  primary that was demoted (``READONLY``) or died is dropped, so after a failover the next command
  (the services retry every ``RedisError``) reaches the promoted replica. The URL's host and port
  are then ignored; its credentials, database and TLS choice still apply to the primary, and the
  Sentinels are dialled with the same TLS choice and their own password
  (``redis_sentinel_password``; Sentinel's ``requirepass`` is separate from the data nodes').

Credentials Redis refuses are a configuration error, not a fault to retry: a service calls
:func:`check_credentials` once at start-up, which raises :class:`~servicekit.serving.StartupError`
naming the setting (the service exits with that one line; the password is never shown). A Redis
that is merely unreachable is left to the callers' retries, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from servicekit.contract.settings import check_settings, setting
from servicekit.redis_layout import DEFAULT_PREFIX, RedisKeys

DEFAULT_MASTER_NAME = "pagedserve"

# Seconds to reach a Sentinel or (re)connect to the primary: bounds how long one retry can hang on
# a host that went away without a reset. Reads stay unbounded: the services block on XREAD.
CONNECT_TIMEOUT_S = 2.0
SENTINEL_TIMEOUT_S = 1.0

# Connections one service opens to Redis at most, and how long a command waits for one of them when
# all are busy before it fails (a RedisError: the callers' retry / 503 path). redis-py's own pool
# refuses at once past 100 (MaxConnectionsError), which turned a burst of a few hundred
# admissions at one gateway into 503s; waiting turns it into queueing. Both are far from Redis's
# own limit (maxclients 10,000), so dozens of replicas fit.
MAX_CONNECTIONS = 128
POOL_WAIT_S = 30.0

# Options of the URL that name the server rather than how to talk to it (Sentinel names it).
_LOCATION_OPTIONS = ("host", "port", "path", "connection_class")


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True, kw_only=True)
class RedisConfig:
    """How a service reaches Redis and names its keys (every service's settings inherit it)."""

    redis_url: str = setting("", help=f"Redis URL; user, password, database and rediss:// TLS apply with "
                                      f"--redis-sentinels too (empty: {DEFAULT_REDIS_URL} for a gateway or a "
                                      f"scheduler; a worker without one does not register; pagedserve serve starts "
                                      f"a Redis of its own)")
    redis_sentinels: tuple[str, ...] = setting(
        (), help="comma-separated Redis Sentinel addresses host:port; when set, the primary is the one they name "
                 "(--redis-master-name) and the Redis URL only gives credentials, database and TLS (rediss://)")
    redis_master_name: str = setting(DEFAULT_MASTER_NAME, help="name the Sentinels monitor the primary under")
    redis_sentinel_password: str = setting("", help="password of the Sentinels themselves (their requirepass; "
                                                    "empty: none)")
    key_prefix: str = setting(DEFAULT_PREFIX, help="prefix of every Redis key, so two stacks can share one Redis")

    def __post_init__(self) -> None:
        check_settings(self)
        validate(self)


@dataclass(frozen=True, kw_only=True)
class OutputStreamConfig:
    """How long output streams stay readable: set by gateways at admission, kept by schedulers on
    every write."""

    output_ttl_s: int = setting(600, minimum=1, help="output streams expire this many seconds after their last "
                                                     "entry (resume window)")


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)``; ``[v6]:port`` keeps the address inside brackets."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"redis_sentinels: expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def validate(settings: RedisConfig) -> None:
    """Raise ValueError naming the field when the Redis settings cannot work."""
    for address in settings.redis_sentinels:
        parse_address(address)
    if settings.redis_sentinels and not settings.redis_master_name:
        raise ValueError("redis_master_name: must be non-empty with redis_sentinels")
    if settings.redis_url:
        from redis.asyncio.connection import parse_url

        parse_url(settings.redis_url)  # raises ValueError naming what is wrong
    RedisKeys(settings.key_prefix)  # raises ValueError when the prefix cannot name keys


def uses_redis(settings: RedisConfig) -> bool:
    """Whether the settings name a Redis at all (a worker may run without one)."""
    return bool(settings.redis_url or settings.redis_sentinels)


def server_url(settings: RedisConfig) -> str:
    """The URL of the one Redis server a gateway or scheduler uses without Sentinels: ``redis_url``,
    or ``DEFAULT_REDIS_URL`` when it is empty."""
    return settings.redis_url or DEFAULT_REDIS_URL


def uses_sentinel(settings: RedisConfig) -> bool:
    return bool(settings.redis_sentinels)


def _fast_packing(connection_class: type) -> type:
    """``connection_class`` packing commands with hiredis's C packer (as redis-py's synchronous
    client does when hiredis is installed; its asyncio connections pack in Python). A step's publish
    and a gateway's output read carry 130 arguments each: 170 µs of CPU packed in Python, 30 µs in
    C, on the services that share the cores with the worker. Same bytes either way; other encodings
    than utf-8 keep redis-py's packer."""
    try:
        import hiredis
    except ImportError:
        return connection_class
    from redis.exceptions import DataError

    class FastPacking(connection_class):
        def pack_command(self, *args):
            encoder = self.encoder
            if encoder.encoding != "utf-8" or encoder.encoding_errors != "strict":
                return super().pack_command(*args)
            # Like redis-py: a command name with a space ("CONFIG GET") is several arguments.
            if isinstance(args[0], str):
                args = (*args[0].encode().split(), *args[1:])
            elif b" " in args[0]:
                args = (*args[0].split(), *args[1:])
            try:
                return [hiredis.pack_command(args)]
            except TypeError as exc:  # redis-py's error for a value it cannot send (None, bool, ...)
                raise DataError(f"Invalid input in {args[0]!r}: {exc}") from None

    FastPacking.__name__ = FastPacking.__qualname__ = f"FastPacking{connection_class.__name__}"
    return FastPacking


def connect(settings: RedisConfig):
    """A ``redis.asyncio.Redis`` for the service's Redis: the one server of ``redis_url``, or the
    primary the Sentinels name; at most ``MAX_CONNECTIONS`` connections, a command waiting up to
    ``POOL_WAIT_S`` for a free one. Connects lazily (on the first command), so a Redis that is not up
    yet surfaces as a ``RedisError`` the caller retries, never here."""
    import redis.asyncio as aioredis
    from redis.asyncio.connection import BlockingConnectionPool, Connection, SSLConnection, parse_url

    pool_limits = {"max_connections": MAX_CONNECTIONS, "timeout": POOL_WAIT_S}
    if not settings.redis_sentinels:
        options = parse_url(server_url(settings))  # what BlockingConnectionPool.from_url passes on
        options["connection_class"] = _fast_packing(options.get("connection_class", Connection))
        return aioredis.Redis.from_pool(BlockingConnectionPool(**options, **pool_limits))
    from redis.asyncio.sentinel import (Sentinel, SentinelConnectionPool, SentinelManagedConnection,
                                        SentinelManagedSSLConnection)

    class BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
        """Sentinel's pool (connections go to the primary it names) that waits for a free
        connection like BlockingConnectionPool instead of refusing."""

    options = parse_url(settings.redis_url) if settings.redis_url else {}
    tls = options.get("connection_class") is SSLConnection
    primary = {k: v for k, v in options.items() if k not in _LOCATION_OPTIONS}
    tls_options = {k: v for k, v in primary.items() if k.startswith("ssl_")}
    sentinel = Sentinel(
        [parse_address(a) for a in settings.redis_sentinels],
        sentinel_kwargs={"password": settings.redis_sentinel_password or None, "ssl": tls, **tls_options,
                         "socket_connect_timeout": SENTINEL_TIMEOUT_S, "socket_timeout": SENTINEL_TIMEOUT_S},
        ssl=tls, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_keepalive=True, **primary)

    class SentinelRedis(aioredis.Redis):
        """The primary's client; closing the one that owns the pool also closes the connections to
        the Sentinels (a single-connection client from ``client()`` owns neither)."""

        async def aclose(self, close_connection_pool: bool | None = None) -> None:
            owner = self.auto_close_connection_pool if close_connection_pool is None else close_connection_pool
            await super().aclose(close_connection_pool)
            if owner:
                await sentinel.aclose()

    connection_class = _fast_packing(SentinelManagedSSLConnection if tls else SentinelManagedConnection)
    return sentinel.master_for(settings.redis_master_name, redis_class=SentinelRedis,
                               connection_pool_class=BlockingSentinelPool, connection_class=connection_class,
                               **pool_limits)


# Error replies that mean "these credentials (or this ACL user) are not accepted".
_AUTH_REPLIES = ("NOAUTH", "WRONGPASS", "NOPERM", "invalid password", "invalid username-password")


def redacted(url: str) -> str:
    """``url`` without its password (safe to log)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def check_credentials(client, settings: RedisConfig) -> None:
    """PING with the service's credentials; StartupError naming ``redis_url`` when Redis refuses
    them. Any other failure (Redis not up yet) passes: the service's own retries handle it."""
    from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError

    from servicekit.serving import StartupError

    try:
        await client.ping()
    except (AuthenticationError, NoPermissionError, ResponseError) as exc:
        if isinstance(exc, ResponseError) and not isinstance(exc, NoPermissionError) and \
                not any(reply in str(exc) for reply in _AUTH_REPLIES):
            return
        await client.aclose()
        raise StartupError(
            f"redis_url (PAGEDSERVE_REDIS_URL): Redis at {redacted(server_url(settings))} refused this client: {exc}. "
            "Put the user and password in the URL (redis://USER:PASSWORD@host:6379/0, or redis://:PASSWORD@host "
            "for requirepass)") from None
    except RedisError:
        return
