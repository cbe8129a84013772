"""``pagedserve scheduler``: the engine loop between Redis and the workers.

Settings come from flags and ``PAGEDSERVE_*`` environment variables (``--help`` lists both) and
are frozen into :class:`~scheduler_service.config.SchedulerConfig` once, here.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping, Sequence

from scheduler_service.config import SchedulerConfig
from servicekit.flags import service_parser, settings_kwargs
from servicekit.serving import service_main

log = logging.getLogger("pagedserve.scheduler")


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    return service_parser(
        "pagedserve scheduler",
        "Run the scheduler: pulls requests from the Redis stream {prefix}requests (consumer "
                    "group 'schedulers') only while its workers have room, keeps one scheduler core and KV "
                    "block pool per worker, drives each worker over a Worker.Step stream, and writes every "
                    "step's tokens to {prefix}out:{request_id}. Serves SchedulerAdmin.Stats, grpc.health.v1 "
                    "and reflection on --port. SIGTERM: stop pulling, report NOT_SERVING, finish held "
                    "requests within --drain-grace-s; unfinished ones stay pending in Redis.", env, SchedulerConfig)


def settings_from_args(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(**settings_kwargs(SchedulerConfig, args))


def make_app(settings: SchedulerConfig):
    from scheduler_service import gc_policy
    from scheduler_service.service import SchedulerApp  # heavy: kept out of ``--help``

    app = SchedulerApp(settings)
    gc_policy.tune()
    return app


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    return service_main("scheduler", build_parser, settings_from_args, make_app, argv, env)


if __name__ == "__main__":
    sys.exit(main())
