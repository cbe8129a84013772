"""Redis with a password and an ACL user: every service reaches it with the credentials in its
``redis_url`` (redis://USER:PASSWORD@host, as redis-py's from_url parses them), and one started
without them (or with a wrong password) stops at start-up with one line naming the setting — no
traceback, no retry loop, no password in the message. A real redis-server with ``requirepass``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers.stack import start_redis_server, stop_redis_server

from servicekit import redis_client
from servicekit.redis_client import redacted
from servicekit.serving import StartupError

ADMIN_PASSWORD = "admin-secret-pw"
USER, USER_PASSWORD = "pagedserve", "user-secret-pw"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    """A redis-server wanting a password: ``requirepass`` for the default user and an ACL user
    limited to the ``sec*`` keys."""
    server = start_redis_server(tmp_path_factory.mktemp("locked-redis"), "--requirepass", ADMIN_PASSWORD,
                                "--user", USER, "on", f">{USER_PASSWORD}", "~sec*", "&*", "+@all")
    yield server.port
    stop_redis_server(server)


async def connect_redis(url: str):
    """What every service does at start-up: its client, then the credentials check."""
    settings = SimpleNamespace(redis_url=url, redis_sentinels=(), redis_master_name="", redis_sentinel_password="")
    client = redis_client.connect(settings)
    await redis_client.check_credentials(client, settings)
    return client


def _url(port: int, credentials: str = "") -> str:
    return f"redis://{credentials}127.0.0.1:{port}/0"


@pytest.mark.parametrize("credentials", ["", f"{USER}:wrong-password@", ":wrong-password@"],
                         ids=["none", "wrong-user-password", "wrong-requirepass"])
async def test_connecting_without_the_right_password_is_a_startup_error_naming_the_setting(locked_redis,
                                                                                           credentials):
    with pytest.raises(StartupError) as err:
        await connect_redis(_url(locked_redis, credentials))
    message = str(err.value)
    assert message.startswith("redis_url (PAGEDSERVE_REDIS_URL): Redis at")
    assert "wrong-password" not in message


@pytest.mark.parametrize("credentials", [f"{USER}:{USER_PASSWORD}@", f":{ADMIN_PASSWORD}@"],
                         ids=["acl-user", "requirepass"])
async def test_the_right_credentials_in_the_url_connect(locked_redis, credentials):
    client = await connect_redis(_url(locked_redis, credentials))
    try:
        assert await client.set("sec:probe", "1")
    finally:
        await client.aclose()


def test_the_password_never_shows_in_a_logged_url():
    assert redacted("rediss://user:s3cret@redis:6380/0") == "rediss://user:***@redis:6380/0"
    assert redacted("redis://redis:6379/0") == "redis://redis:6379/0"


@pytest.mark.parametrize("service", ["gateway", "scheduler", "worker"])
def test_a_service_without_the_password_exits_with_one_line(locked_redis, tiny_model_dir, service, capsys):
    from pagedserve.cli import main

    argv = {"gateway": ["--model", tiny_model_dir, "--port", "0"],
            "scheduler": ["--port", "0"],
            "worker": ["--model", tiny_model_dir, "--port", "0", "--simulate-step-latency", "0,0"]}[service]
    code = main([service, *argv, "--redis-url", _url(locked_redis, ":wrong-password@")])
    err = capsys.readouterr().err
    assert code == 1
    assert f"pagedserve {service}: redis_url (PAGEDSERVE_REDIS_URL): Redis at" in err
    assert "Traceback" not in err and "wrong-password" not in err


async def test_a_scheduler_with_the_acl_user_starts_and_drains(locked_redis):
    from scheduler_service.service import SchedulerApp
    from scheduler_service.config import SchedulerConfig

    app = SchedulerApp(SchedulerConfig(redis_url=_url(locked_redis, f"{USER}:{USER_PASSWORD}@"),
                                         key_prefix="secacl:", port=0, poll_block_ms=100, drain_grace_s=1))
    await app.start()
    await app.drain(1)
