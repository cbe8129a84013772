"""``pagedserve gateway``: the stateless gRPC front door.

Settings come from flags and ``PAGEDSERVE_*`` environment variables (``--help`` lists both) and
are frozen into :class:`~gateway_service.config.GatewayConfig` once, here.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sys
from collections.abc import Mapping, Sequence

from gateway_service.config import GatewayConfig
from servicekit import redis_client, sampling_defaults
from servicekit.auth import ConcurrencyLimits, KeyStore, TokenRateLimits
from servicekit.contract.errors import UnavailableError
from servicekit.flags import service_parser, settings_kwargs
from servicekit.serving import StartupError, cancel_and_wait, is_loopback, service_main
from servicekit.tls import describe as describe_link

log = logging.getLogger("pagedserve.gateway")

HAND_OVER_S = 2.0  # past the drain grace: for live calls to end UNAVAILABLE before the server stops
READINESS_CHECK_S = 1.0  # how often the Generation service's grpc.health.v1 status follows readiness


def tenant_resolver(api_keys: KeyStore, source: str):
    """``tenant_of(owner, user)`` for ``--tenant-from`` ``source``: the tenant and weight of the
    caller's key (``key``), the request's end-user field with no weight (``user``), or the key's
    when keys are configured, else the user (``auto``)."""
    by_key = source == "key" or (source == "auto" and api_keys.enabled)

    def tenant_of(owner: str, user: str) -> tuple[str, float]:
        if by_key:
            return api_keys.tenant(owner)
        return user, 0.0

    return tenant_of


class GatewayApp:
    """A running gateway. ``redis`` and ``hf_tokenizer`` may be injected (tests share them)."""

    def __init__(self, settings: GatewayConfig, *, redis=None, hf_tokenizer=None) -> None:
        self.settings = settings
        self._redis = redis
        self._owns_redis = redis is None
        self._hf_tokenizer = hf_tokenizer
        self.service = None
        self.lifecycle = None
        self._limits = None
        self._fanout = None
        self._http = None
        self._responses = None
        self._readiness_task: asyncio.Task | None = None
        self.port = 0
        self.http_port = -1  # -1: no HTTP API

    async def start(self) -> None:
        from prometheus_client import CollectorRegistry

        from gateway_service.generation import GenerationService
        from gateway_service.grpc_server import build_server
        from gateway_service.metrics import GatewayMetrics
        from gateway_service.model_limits import ModelLimitsView, config_limits
        from gateway_service.output_fanout import OutputFanout
        from gateway_service.admission import Admission
        from gateway_service.text import PromptTokenizer, load_tokenizer
        from servicekit.redis_layout import RedisKeys, ensure_request_group

        s = self.settings
        keys = RedisKeys(s.key_prefix)
        api_keys = self._key_store()
        if self._redis is None:
            self._redis = redis_client.connect(s)
            await redis_client.check_credentials(self._redis, s)
        if self._hf_tokenizer is None:
            self._hf_tokenizer = await asyncio.to_thread(load_tokenizer, s.model)
        await ensure_request_group(self._redis, keys)
        defaults, origin = await asyncio.to_thread(sampling_defaults.for_model, s.sampling_defaults, s.model)
        log.info("sampling defaults for requests that leave them unset: %s (%s)",
                 ", ".join(f"{k}={v:g}" for k, v in defaults.items()) or "OpenAI's (temperature=1, no filter)", origin)
        fallback = functools.cache(lambda: config_limits(s.model, self._hf_tokenizer))  # read once, if ever needed
        self._limits = ModelLimitsView(self._redis, keys, s.model, refresh_s=s.registry_refresh_s, fallback=fallback)
        self._fanout = OutputFanout(self._redis, keys, s.gateway_id, block_ms=s.read_block_ms,
                                    outage_s=s.redis_outage_s)
        admission = Admission(self._redis, keys, max_queued=s.max_queued_requests, output_ttl_s=s.output_ttl_s,
                              replica_wait_ms=s.admission_replica_wait_ms)
        registry = CollectorRegistry()
        metrics = GatewayMetrics(registry, s.model)
        self.service = GenerationService(model=s.model, keys=keys, tokenizer=PromptTokenizer(self._hf_tokenizer),
                                         limits=self._limits, admission=admission, fanout=self._fanout,
                                         prompt_bytes_per_token=s.prompt_bytes_per_token,
                                         structured_output_limits=(s.max_structured_output_bytes,
                                                                   s.structured_output_check_s),
                                         per_key=ConcurrencyLimits(s.max_requests_per_key),
                                         tokens_per_key=TokenRateLimits(s.max_tokens_per_key_per_minute),
                                         max_buffered_outputs=s.max_buffered_outputs, metrics=metrics,
                                         tool_parser=s.tool_call_parser, sampling_defaults=defaults,
                                         worker_wait_s=s.worker_wait_s,
                                         tenant_of=tenant_resolver(api_keys, s.tenant_from))
        metrics.streams.set_function(lambda: self.service.in_flight)
        self.lifecycle = build_server(self.service, s, api_keys, registry)
        self.port = self.lifecycle.bind(f"{s.host}:{s.port}", s.tls)
        if s.http_port >= 0:
            # Same event loop as gRPC: an HTTP call runs the very coroutines a Generate call runs,
            # behind the same API keys.
            from gateway_service.http_api import OpenAIHttpApi
            from gateway_service.response_store import ResponseStore
            from gateway_service.responses_api import ResponsesApi
            from servicekit.http_server import HttpServer

            self._responses = ResponsesApi(self.service, ResponseStore(self._redis, keys, ttl_s=s.response_ttl_s),
                                           self._fanout, admission, s.gateway_id)
            api = OpenAIHttpApi(self.service, registry, keys=api_keys, max_choices=s.max_requests_per_call,
                                responses=self._responses)
            self._http = HttpServer(api.app, name="gateway", tls=s.tls)
            self.http_port = self._http.bind(s.http_host or s.host, s.http_port)
        self._limits.start()
        self._fanout.start()
        await self.lifecycle.start()
        await self._publish_readiness()
        self._readiness_task = asyncio.create_task(self._track_readiness(), name="gateway readiness")
        if self._http is not None:
            await self._http.start()
        log.info("gateway %s for %s listening on %s:%d (gRPC), HTTP %s (%s, %s)", s.gateway_id, s.model, s.host,
                 self.port, f"on {s.http_host or s.host}:{self.http_port}" if self._http is not None else "off",
                 describe_link(s.tls),
                 f"{len(api_keys)} API keys" if api_keys.enabled else "no API keys")

    async def _publish_readiness(self) -> bool:
        """grpc.health.v1 of pagedserve.v1.Generation is readiness, as /readyz (the overall ""
        status is liveness): SERVING while a request sent now is admitted and served."""
        ready, _missing = await self.service.readiness()
        await self.lifecycle.set_serving(ready)
        return ready

    async def _track_readiness(self) -> None:
        ready = None
        while True:
            await asyncio.sleep(READINESS_CHECK_S)
            try:
                now = await self._publish_readiness()
            except Exception as exc:  # noqa: BLE001 - Redis away: the next round tells
                log.debug("readiness not checked: %s", exc)
                continue
            if now != ready and ready is not None:
                log.info("gateway %s (the Generation service's grpc.health.v1 status)", "ready" if now else "not ready")
            ready = now

    def _key_store(self) -> KeyStore:
        s = self.settings
        try:
            store = KeyStore(s.api_keys, s.api_keys_file)
        except (OSError, ValueError) as exc:
            raise StartupError(f"api_keys_file (PAGEDSERVE_API_KEYS_FILE): {exc}") from None
        if not store.enabled and not is_loopback(s.host):
            log.warning("no API keys configured (--api-keys / --api-keys-file): anyone who reaches %s:%d may "
                        "generate and resume requests by id", s.host, s.port)
        return store

    async def _finish_or_hand_over(self, grace_s: float) -> None:
        """Live calls finish within ``grace_s``; those still live then end UNAVAILABLE without
        aborting their requests, which run on: an SDK client resumes each on another gateway from
        the next output index (rather than seeing its call cancelled by the server stopping)."""
        try:
            await asyncio.wait_for(self.service.wait_idle(), timeout=grace_s)
            return
        except asyncio.TimeoutError:
            pass
        log.warning("drain grace of %.1fs passed with %d calls live: ending them UNAVAILABLE (their requests go on; "
                    "SDK clients resume them on another gateway)", grace_s, self.service.in_flight)
        self._fanout.fail_all(UnavailableError("the gateway is shutting down; the request goes on: resume it on "
                                               "another gateway"))
        await self.service.wait_idle()

    async def drain(self, grace_s: float | None = None) -> None:
        """NOT_SERVING and no new Generate calls; live streams finish within the grace period."""
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        if self.service is not None:
            self.service.draining = True
        if self._readiness_task is not None:
            await cancel_and_wait([self._readiness_task])
        if self.lifecycle is not None:
            await self.lifecycle.drain(grace + HAND_OVER_S, lambda: self._finish_or_hand_over(grace))
        if self._responses is not None:  # background responses still produced here: taken over elsewhere
            await self._responses.close()
        if self._http is not None:  # its streams ended with the drain above; idle keep-alives close now
            await self._http.stop(1.0)
        if self._fanout is not None:
            await self._fanout.stop()
        if self._limits is not None:
            await self._limits.stop()
        if self._owns_redis and self._redis is not None:
            await self._redis.aclose()


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    return service_parser(
        "pagedserve gateway",
        "Run a gateway: the public pagedserve.v1.Generation gRPC service (Generate, Tokenize, "
                    "ModelInfo) plus grpc.health.v1 and reflection, and the OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
                    "/metrics) on --http-port. Stateless: validates and tokenizes each "
                    "request, enqueues it in Redis ({prefix}requests), streams its tokens back from "
                    "{prefix}out:{request_id} as text, applies stop strings, aborts requests whose client "
                    "left. Learns the model's limits from the workers registered in Redis. SIGTERM: report "
                    "NOT_SERVING, refuse new calls, let live streams finish within --drain-grace-s.", env, GatewayConfig)


def settings_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(**settings_kwargs(GatewayConfig, args))


def make_app(settings: GatewayConfig) -> GatewayApp:
    return GatewayApp(settings)

def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    return service_main("gateway", build_parser, settings_from_args, make_app, argv, env)


if __name__ == "__main__":
    sys.exit(main())
