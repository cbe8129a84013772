"""The gateway's settings: one frozen dataclass, built once in ``main()`` from flags and
``PAGEDSERVE_*`` environment variables. It inherits the concerns it shares with other services
(server, Redis, output streams, TLS); every field is range-checked by its declaration."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from servicekit import redis_client, sampling_defaults
from gateway_service.tool_calls import DEFAULT_PARSER, PARSERS
from servicekit.contract.settings import setting
from servicekit.grammar import CHECK_TIMEOUT_S, MAX_SPEC_BYTES
from servicekit.model_registry import ModelConfig
from servicekit.ports import GATEWAY_HTTP_PORT, GATEWAY_PORT
from servicekit.redis_client import OutputStreamConfig, RedisConfig
from servicekit.service_config import PORT_RANGE, ServerConfig
from servicekit.tls import TlsConfig

REPLICA_WAIT_MODES = ("auto", "on", "off")


@dataclass(frozen=True, kw_only=True)
class GatewayPorts:
    """Where a gateway serves its APIs (``pagedserve serve`` takes the same fields)."""

    port: int = setting(GATEWAY_PORT, **PORT_RANGE, help="gRPC port to listen on (0 = any free port)")
    http_port: int = setting(GATEWAY_HTTP_PORT, minimum=-1, maximum=65535,
                             help="port of the OpenAI-compatible HTTP API and /metrics (0 = any free port, -1 = no "
                                  "HTTP)")


@dataclass(frozen=True, kw_only=True)
class SamplingDefaultsConfig:
    """The sampling a request gets for the fields it leaves unset (``pagedserve serve`` takes it too)."""

    sampling_defaults: str = setting(
        sampling_defaults.AUTO,
        help="temperature / top_k / top_p / min_p / repetition_penalty a request leaves unset: auto = the model's "
             "generation_config.json or GGUF general.sampling metadata, else pagedserve's for its short names "
             "(smollm2-135m: greedy), else OpenAI's (temperature 1, no filter); neutral = OpenAI's always; or a "
             "JSON object over auto's, e.g. '{\"temperature\": 0.7, \"top_p\": 0.9}'. Explicit request values win")

    def __post_init__(self) -> None:
        if self.sampling_defaults not in (sampling_defaults.AUTO, sampling_defaults.NEUTRAL):
            sampling_defaults.parse_overrides(self.sampling_defaults)


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(ModelConfig, ServerConfig, GatewayPorts, SamplingDefaultsConfig, RedisConfig, OutputStreamConfig, TlsConfig):
    """Every knob of a gateway; each field is also a flag and an env var."""

    http_host: str = setting("", help="interface of the OpenAI-compatible HTTP API and /metrics (empty: --host)")

    max_queued_requests: int = setting(
        1024, minimum=0, help="requests waiting in Redis beyond which Generate answers RESOURCE_EXHAUSTED (0: no limit)")
    max_requests_per_call: int = setting(
        2048, minimum=0, help="requests one OpenAI HTTP call may ask for (prompts x n); more is a 400 before any prompt is "
                   "tokenized (0: no limit)")
    registry_refresh_s: float = setting(2.0, above=0, help="worker registry re-read period")
    worker_wait_s: float = setting(
        0.0, minimum=0, help="scale from zero: while no worker of the model is registered, admit requests anyway and let "
                             "each wait in the queue this long for one (its deadline if sooner), then fail it with "
                             "UNAVAILABLE; the model's limits come from the last worker seen (kept in Redis), else its "
                             "config. 0: refuse at once with UNAVAILABLE")
    read_block_ms: int = setting(1000, minimum=1, help="longest blocking XREAD of the output fan-out loop")
    redis_outage_s: float = setting(10.0, above=0, help="live streams fail with UNAVAILABLE (the SDK resumes them) after "
                                               "this long without Redis")
    wait_for_replica: str = setting(
        "auto", choices=REPLICA_WAIT_MODES,
        help="before a stream starts, wait until a replica holds its admission (WAIT 1), whenever the primary has "
             "replicas, so a failover loses no admitted request: on, off, or auto (on with --redis-sentinels)")
    replica_wait_ms: int = setting(1000, minimum=1, help="longest wait for a replica's acknowledgement; past it the request "
                                              "is admitted anyway and a warning logged")
    gateway_id: str = setting(default_factory=lambda: uuid.uuid4().hex[:12],
                              help="names this gateway's wake and live streams in Redis")
    # The most UTF-8 bytes one token covers, as far as sizing goes: 16 leaves room for long tokens
    # (runs of spaces in code); English averages ~4 bytes per token.
    max_structured_output_bytes: int = setting(
        MAX_SPEC_BYTES, minimum=1, help="largest constraint of a structured-output request (a JSON schema, regex, grammar "
                                        "or choice list, in bytes); larger: INVALID_ARGUMENT")
    structured_output_check_s: float = setting(
        CHECK_TIMEOUT_S, above=0, help="longest the gateway spends checking one constraint (a schema that takes longer "
                                       "to parse is refused: it would stall a worker's steps)")
    tool_call_parser: str = setting(
        DEFAULT_PARSER, choices=PARSERS, help="how a chat answer with tool_choice auto is read for tool calls: hermes = "
                                              "<tool_call>{json}</tool_call> blocks, the rest content; json = an answer "
                                              "that is a call object (or an array of them)")
    prompt_bytes_per_token: int = setting(
        16, minimum=1, help="text over max_model_len times this many UTF-8 bytes is refused (INVALID_ARGUMENT) before it is "
                 "tokenized")
    # Security (docs/operations.md).
    api_keys: tuple[str, ...] = setting(
        (), secret=True, help="comma-separated API keys clients must send as 'authorization: Bearer KEY' (or "
                              "'sha256:HEX' digests); with --api-keys-file, either one admits (empty and no file: "
                              "open to anyone who reaches the port)")
    api_keys_file: str = setting("", help="file of API keys, one per line ('sha256:HEX' digests allowed, '#' "
                                          "comments); re-read when it changes, so keys are added or revoked live")
    tenant_from: str = setting(
        "auto", choices=("auto", "key", "user"),
        help="whose fair share a request counts against (a scheduler's --policy fair): key = the tenant its API key "
             "names in the keys file ('KEY tenant=NAME weight=W'; else the key itself), user = the request's end-user "
             "field (OpenAI's user, Anthropic's metadata.user_id, the SDK's user), auto = key when API keys are "
             "configured, else user")
    max_requests_per_key: int = setting(0, minimum=0, help="Generate streams one API key may have open on this gateway; more "
                                                "is RESOURCE_EXHAUSTED (0: no limit)")
    max_tokens_per_key_per_minute: int = setting(
        0, minimum=0, help="prompt plus generated tokens one API key may use per minute on this gateway; past it Generate is "
                "RESOURCE_EXHAUSTED (0: no limit)")
    reflection: bool = setting(True, help="serve gRPC reflection (open to all: it lists the methods)")
    max_message_bytes: int = setting(16 * 1024 * 1024, minimum=1, help="largest gRPC message received or sent")
    max_concurrent_streams: int = setting(256, minimum=1, help="concurrent calls one client connection may have open")
    response_ttl_s: int = setting(
        86400, minimum=1, help="stored Responses API responses (/v1/responses, store: true) are kept in Redis this many "
                               "seconds after their last change: retrieval, previous_response_id, input_items and "
                               "resumed event streams work on every gateway within it")
    max_buffered_outputs: int = setting(
        4096, minimum=1, help="output records one Generate stream may have waiting for its client; a client that reads slower "
                   "than that is cut off with RESOURCE_EXHAUSTED and its request aborted (bounds gateway memory)")

    @property
    def admission_replica_wait_ms(self) -> int:
        """How long an admission waits for a replica's acknowledgement (0: it does not wait)."""
        on = self.wait_for_replica == "on" or (self.wait_for_replica == "auto" and redis_client.uses_sentinel(self))
        return self.replica_wait_ms if on else 0

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)  # every field's range, and a model named
        SamplingDefaultsConfig.__post_init__(self)
        redis_client.validate(self)
        self.tls.check(server=True)
