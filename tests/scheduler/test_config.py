"""The scheduler's settings (``scheduler_service.config``): lists and booleans from flags and env vars."""

from __future__ import annotations


def test_scheduler_settings_parse_worker_lists_and_booleans():
    from scheduler_service.main import build_parser, settings_from_args

    env = {"PAGEDSERVE_ENABLE_PREFIX_CACHING": "false"}
    settings = settings_from_args(build_parser(env).parse_args(["--workers", "a:1, b:2"]))
    assert settings.workers == ("a:1", "b:2") and settings.enable_prefix_caching is False
