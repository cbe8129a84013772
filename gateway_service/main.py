"""``pagedserve gateway``: the stateless gRPC front door.

Settings come from flags and ``PAGEDSERVE_*`` environment variables (``--help`` lists both) and
are frozen into :class:`~gateway_service.settings.GatewaySettings` once, here.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Mapping, Sequence

from servicekit.flags import add_common_flags, add_flag
from servicekit.serving import service_main
from gateway_service.settings import DEFAULT_PORT, GatewaySettings

log = logging.getLogger("pagedserve.gateway")


class GatewayApp:
    """A running gateway. ``redis`` and ``hf_tokenizer`` may be injected (tests share them)."""

    def __init__(self, settings: GatewaySettings, *, redis=None, hf_tokenizer=None) -> None:
        self.settings = settings
        self._redis = redis
        self._owns_redis = redis is None
        self._hf_tokenizer = hf_tokenizer
        self.service = None
        self.lifecycle = None
        self._limits = None
        self._fanout = None
        self.port = 0

    async def start(self) -> None:
        from gateway_service.generation import GenerationService
        from gateway_service.grpc_server import build_server
        from gateway_service.model_limits import ModelLimitsView
        from gateway_service.output_fanout import OutputFanout
        from gateway_service.request_queue import RequestQueue
        from gateway_service.text import PromptTokenizer, load_tokenizer
        from servicekit.redis_keys import RedisKeys, ensure_request_group

        s = self.settings
        keys = RedisKeys(s.key_prefix)
        if self._redis is None:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(s.redis_url)
        if self._hf_tokenizer is None:
            self._hf_tokenizer = await asyncio.to_thread(load_tokenizer, s.model)
        await ensure_request_group(self._redis, keys)
        self._limits = ModelLimitsView(self._redis, keys, s.model, refresh_s=s.registry_refresh_s)
        self._fanout = OutputFanout(self._redis, keys, s.gateway_id, block_ms=s.read_block_ms,
                                    outage_s=s.redis_outage_s)
        queue = RequestQueue(self._redis, keys, max_queued=s.max_queued_requests, output_ttl_s=s.output_ttl_s)
        self.service = GenerationService(model=s.model, keys=keys, tokenizer=PromptTokenizer(self._hf_tokenizer),
                                         limits=self._limits, queue=queue, fanout=self._fanout,
                                         prompt_bytes_per_token=s.prompt_bytes_per_token)
        self.lifecycle = build_server(self.service)
        self.port = self.lifecycle.bind(f"{s.host}:{s.port}")
        self._limits.start()
        self._fanout.start()
        await self.lifecycle.start()
        log.info("gateway %s for %s listening on %s:%d", s.gateway_id, s.model, s.host, self.port)

    async def drain(self, grace_s: float | None = None) -> None:
        """NOT_SERVING and no new Generate calls; live streams finish within the grace period."""
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        if self.service is not None:
            self.service.draining = True
        if self.lifecycle is not None:
            await self.lifecycle.drain(grace, self.service.wait_idle)
        if self._fanout is not None:
            await self._fanout.stop()
        if self._limits is not None:
            await self._limits.stop()
        if self._owns_redis and self._redis is not None:
            await self._redis.aclose()


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve gateway",
        description="Run a gateway: the public pagedserve.v1.Generation gRPC service (Generate, Tokenize, "
                    "ModelInfo) plus grpc.health.v1 and reflection. Stateless: validates and tokenizes each "
                    "request, enqueues it in Redis ({prefix}requests), streams its tokens back from "
                    "{prefix}out:{request_id} as text, applies stop strings, aborts requests whose client "
                    "left. Learns the model's limits from the workers registered in Redis. SIGTERM: report "
                    "NOT_SERVING, refuse new calls, let live streams finish within --drain-grace-s.")
    add_flag(parser, env, "model", default="smollm2-135m",
             help="the served model: its tokenizer is loaded from here, and it must be the name the workers "
                  "were started with")
    add_flag(parser, env, "host", default="127.0.0.1", help="interface to listen on (0.0.0.0 in containers)")
    add_flag(parser, env, "port", type=int, default=DEFAULT_PORT, help="port to listen on (0 = any free port)")
    add_common_flags(parser, env)
    add_flag(parser, env, "max-queued-requests", type=int, default=1024,
             help="requests waiting in Redis beyond which Generate answers RESOURCE_EXHAUSTED (0: no limit)")
    add_flag(parser, env, "output-ttl-s", type=int, default=600,
             help="output streams expire this many seconds after their last entry (resume window)")
    add_flag(parser, env, "registry-refresh-s", type=float, default=2.0, help="worker registry re-read period")
    add_flag(parser, env, "gateway-id", default="", help="names this gateway's wake stream (default: random)")
    add_flag(parser, env, "redis-outage-s", type=float, default=10.0,
             help="live streams fail with UNAVAILABLE (the SDK resumes them) after this long without Redis")
    add_flag(parser, env, "prompt-bytes-per-token", type=int,
             default=GatewaySettings.__dataclass_fields__["prompt_bytes_per_token"].default,
             help="text over max_model_len times this many UTF-8 bytes is refused (INVALID_ARGUMENT) before it "
                  "is tokenized")
    return parser


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    extra = {"gateway_id": args.gateway_id} if args.gateway_id else {}
    return GatewaySettings(
        model=args.model, host=args.host, port=args.port, redis_url=args.redis_url, key_prefix=args.key_prefix,
        max_queued_requests=args.max_queued_requests, output_ttl_s=args.output_ttl_s,
        registry_refresh_s=args.registry_refresh_s, drain_grace_s=args.drain_grace_s,
        redis_outage_s=args.redis_outage_s, prompt_bytes_per_token=args.prompt_bytes_per_token, **extra)


def make_app(settings: GatewaySettings) -> GatewayApp:
    return GatewayApp(settings)

def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    return service_main("gateway", build_parser, settings_from_args, make_app, argv, env)


if __name__ == "__main__":
    sys.exit(main())
