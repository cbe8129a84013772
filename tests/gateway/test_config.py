"""The gateway's settings (``gateway_service.config``): flags over env vars over defaults."""

from __future__ import annotations


def test_settings_come_from_flags_over_env_over_defaults():
    from gateway_service.main import build_parser, settings_from_args
    from servicekit import redis_client

    env = {"PAGEDSERVE_PORT": "6000", "PAGEDSERVE_MAX_QUEUED_REQUESTS": "7", "PAGEDSERVE_KEY_PREFIX": "x:"}
    settings = settings_from_args(build_parser(env).parse_args(["--port", "6001"]))
    assert (settings.port, settings.max_queued_requests, settings.key_prefix) == (6001, 7, "x:")
    assert redis_client.server_url(settings) == "redis://127.0.0.1:6379/0"
