"""``pagedserve scheduler``: the engine loop between Redis and the workers.

Settings come from flags and ``PAGEDSERVE_*`` environment variables (``--help`` lists both) and
are frozen into :class:`~scheduler_service.settings.SchedulerSettings` once, here.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping, Sequence

from pagedserve.flags import add_common_flags, add_flag
from pagedserve.serving import service_main
from scheduler_service.core.config import DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD, POLICIES
from scheduler_service.settings import DEFAULT_PORT, SchedulerSettings, default_consumer

log = logging.getLogger("pagedserve.scheduler")


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve scheduler",
        description="Run the scheduler: pulls requests from the Redis stream {prefix}requests (consumer "
                    "group 'schedulers') only while its workers have room, keeps one scheduler core and KV "
                    "block pool per worker, drives each worker over a Worker.Step stream, and writes every "
                    "step's tokens to {prefix}out:{request_id}. Serves SchedulerAdmin.Stats, grpc.health.v1 "
                    "and reflection on --port. SIGTERM: stop pulling, report NOT_SERVING, finish held "
                    "requests within --drain-grace-s; unfinished ones stay pending in Redis.")
    add_flag(parser, env, "workers", default="",
             help="comma-separated worker addresses host:port (empty: find workers in the Redis registry)")
    add_flag(parser, env, "host", default="127.0.0.1", help="interface of the stats/health server")
    add_flag(parser, env, "port", type=int, default=DEFAULT_PORT, help="port of the stats/health server (0 = any)")
    add_flag(parser, env, "consumer", default="", help="consumer name in the Redis group (default: host-pid-random)")
    add_common_flags(parser, env)
    add_flag(parser, env, "max-num-seqs", type=int, default=0,
             help="running requests per worker (0: the worker's batch size; never more)")
    add_flag(parser, env, "max-num-batched-tokens", type=int, default=0,
             help="token budget of one step (0: the worker's limit; never more)")
    add_flag(parser, env, "long-prefill-token-threshold", type=int, default=0,
             help="cap of one prefill chunk (0: off)")
    add_flag(parser, env, "shared-prefill-token-threshold", type=int, default=DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD,
             help="cap of one prefill chunk while other requests wait or run, for fair time to first token (0: off)")
    add_flag(parser, env, "enable-chunked-prefill", type=bool, default=True, help="split long prompts over steps")
    add_flag(parser, env, "enable-prefix-caching", type=bool, default=True, help="reuse KV blocks of shared prefixes")
    add_flag(parser, env, "policy", default="fcfs", choices=list(POLICIES), help="waiting-queue order")
    add_flag(parser, env, "max-queued-per-worker", type=int, default=0,
             help="requests pulled per worker beyond its batch (0: as many as max-num-seqs)")
    add_flag(parser, env, "output-ttl-s", type=int, default=600,
             help="output streams expire this many seconds after their last entry (resume window)")
    add_flag(parser, env, "discovery-interval-s", type=float, default=2.0, help="registry scan / reconnect period")
    add_flag(parser, env, "lease-ttl-s", type=float, default=10.0,
             help="lifetime of this scheduler's worker leases and registry entry (renewed every third): "
                  "a dead scheduler's workers are free for others after at most this long")
    add_flag(parser, env, "reclaim-idle-s", type=float, default=10.0,
             help="a request entry not refreshed for this long belongs to a dead scheduler and is taken over "
                  "(XAUTOCLAIM); live schedulers refresh theirs every fifth of it")
    add_flag(parser, env, "max-retries", type=int, default=3,
             help="takeovers of one request before it goes to the dead-letter stream {prefix}dead")
    return parser


def settings_from_args(args: argparse.Namespace) -> SchedulerSettings:
    return SchedulerSettings(
        redis_url=args.redis_url, key_prefix=args.key_prefix,
        workers=tuple(a.strip() for a in args.workers.split(",") if a.strip()),
        host=args.host, port=args.port, consumer=args.consumer or default_consumer(),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        shared_prefill_token_threshold=args.shared_prefill_token_threshold,
        enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
        policy=args.policy, max_queued_per_worker=args.max_queued_per_worker, output_ttl_s=args.output_ttl_s,
        discovery_interval_s=args.discovery_interval_s, drain_grace_s=args.drain_grace_s,
        lease_ttl_s=args.lease_ttl_s, reclaim_idle_s=args.reclaim_idle_s, max_retries=args.max_retries)


def make_app(settings: SchedulerSettings):
    from scheduler_service.service import SchedulerApp  # heavy: kept out of ``--help``

    return SchedulerApp(settings)

def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    return service_main("scheduler", build_parser, settings_from_args, make_app, argv, env)


if __name__ == "__main__":
    sys.exit(main())
