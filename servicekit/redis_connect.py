"""Every service's Redis client, from its ``redis_url`` setting, checked once at start-up.

The URL carries the credentials and transport (redis-py's ``from_url`` parses them):
``redis://user:password@host:6379/0`` (an ACL user; ``redis://:password@host`` for the ``default``
user's ``requirepass``), ``rediss://...`` for TLS, with ``?ssl_ca_certs=/path/ca.pem`` (and
``ssl_certfile``/``ssl_keyfile`` for a client certificate) as query parameters.

A Redis that refuses the credentials (or the ACL user may not run a command the service needs)
is a configuration error, not a fault to retry: :func:`connect_redis` raises
:class:`~servicekit.serving.StartupError` naming the setting, and the service exits with that
one line instead of a traceback or a retry loop. The password never appears in messages.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from servicekit.serving import StartupError

_AUTH_REPLIES = ("NOAUTH", "WRONGPASS", "NOPERM", "invalid password", "invalid username-password")


def redacted(url: str) -> str:
    """``url`` without its password (safe to log)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def connect_redis(url: str, *, setting: str = "redis_url"):
    """A ``redis.asyncio`` client for ``url`` that answered a PING with its credentials."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    try:
        await client.ping()
    except (AuthenticationError, NoPermissionError, ResponseError) as exc:
        await client.aclose()
        if isinstance(exc, ResponseError) and not any(r in str(exc) for r in _AUTH_REPLIES):
            raise
        env = "PAGEDSERVE_" + setting.upper()
        raise StartupError(
            f"{setting} ({env}): Redis at {redacted(url)} refused this client: {exc}. Put the user and password "
            "in the URL (redis://USER:PASSWORD@host:6379/0, or redis://:PASSWORD@host for requirepass)") from None
    return client
