"""The gateway's settings (``gateway_service.main``): flags over env vars over defaults."""

from __future__ import annotations


def test_settings_come_from_flags_over_env_over_defaults():
    from gateway_service.main import build_parser, settings_from_args

    env = {"PAGEDSERVE_PORT": "6000", "PAGEDSERVE_MAX_QUEUED_REQUESTS": "7", "PAGEDSERVE_KEY_PREFIX": "x:"}
    settings = settings_from_args(build_parser(env).parse_args(["--port", "6001"]))
    assert (settings.port, settings.max_queued_requests, settings.key_prefix) == (6001, 7, "x:")
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
