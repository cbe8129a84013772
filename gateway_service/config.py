"""The gateway's settings: one frozen dataclass, built once in ``main()`` from flags and
``PAGEDSERVE_*`` environment variables (STYLE.md habit 4)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from servicekit import redis_client
from servicekit.flags import (
    check_port,
    drain_grace_setting,
    key_prefix_setting,
    output_ttl_setting,
    redis_url_setting,
    setting,
    tls_ca_setting,
    tls_cert_setting,
    tls_key_setting,
)
from servicekit.ports import GATEWAY_HTTP_PORT, GATEWAY_PORT
from servicekit.redis_keys import RedisKeys
from servicekit.tls import TlsFiles

DEFAULT_PORT = GATEWAY_PORT
REPLICA_WAIT_MODES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Every knob of a gateway; each field declared with ``setting`` is also a flag and an env var."""

    model: str = setting("smollm2-135m", help="the served model: its tokenizer is loaded from here, and it must be "
                                              "the name the workers were started with")
    host: str = setting("127.0.0.1", help="interface to listen on (0.0.0.0 in containers)")
    port: int = setting(DEFAULT_PORT, help="port to listen on (0 = any free port)")
    http_host: str = setting("", help="interface of the OpenAI-compatible HTTP API and /metrics (empty: --host)")
    http_port: int = setting(GATEWAY_HTTP_PORT, help="port of the OpenAI-compatible HTTP API and /metrics (0 = any free port, "
                                        "-1 = no HTTP)")
    redis_url: str = redis_url_setting()
    redis_sentinels: tuple[str, ...] = redis_client.redis_sentinels_setting()
    redis_master_name: str = redis_client.redis_master_name_setting()
    redis_sentinel_password: str = redis_client.redis_sentinel_password_setting()
    key_prefix: str = key_prefix_setting()
    max_queued_requests: int = setting(
        1024, help="requests waiting in Redis beyond which Generate answers RESOURCE_EXHAUSTED (0: no limit)")
    max_requests_per_call: int = setting(
        2048, help="requests one OpenAI HTTP call may ask for (prompts x n); more is a 400 before any prompt is "
                   "tokenized (0: no limit)")
    output_ttl_s: int = output_ttl_setting()
    registry_refresh_s: float = setting(2.0, help="worker registry re-read period")
    read_block_ms: int = setting(1000, help="longest blocking XREAD of the output fan-out loop")
    redis_outage_s: float = setting(10.0, help="live streams fail with UNAVAILABLE (the SDK resumes them) after "
                                               "this long without Redis")
    wait_for_replica: str = setting(
        "auto", choices=REPLICA_WAIT_MODES,
        help="before a stream starts, wait until a replica holds its admission (WAIT 1), whenever the primary has "
             "replicas, so a failover loses no admitted request: on, off, or auto (on with --redis-sentinels)")
    replica_wait_ms: int = setting(1000, help="longest wait for a replica's acknowledgement; past it the request "
                                              "is admitted anyway and a warning logged")
    gateway_id: str = setting(default_factory=lambda: uuid.uuid4().hex[:12],
                              help="names this gateway's wake and live streams in Redis")
    drain_grace_s: float = drain_grace_setting()
    # The most UTF-8 bytes one token covers, as far as sizing goes: 16 leaves room for long tokens
    # (runs of spaces in code); English averages ~4 bytes per token.
    prompt_bytes_per_token: int = setting(
        16, help="text over max_model_len times this many UTF-8 bytes is refused (INVALID_ARGUMENT) before it is "
                 "tokenized")
    # Security (README "Security").
    api_keys: tuple[str, ...] = setting(
        (), secret=True, help="comma-separated API keys clients must send as 'authorization: Bearer KEY' (or "
                              "'sha256:HEX' digests); with --api-keys-file, either one admits (empty and no file: "
                              "open to anyone who reaches the port)")
    api_keys_file: str = setting("", help="file of API keys, one per line ('sha256:HEX' digests allowed, '#' "
                                          "comments); re-read when it changes, so keys are added or revoked live")
    max_requests_per_key: int = setting(0, help="Generate streams one API key may have open on this gateway; more "
                                                "is RESOURCE_EXHAUSTED (0: no limit)")
    max_tokens_per_key_per_minute: int = setting(
        0, help="prompt plus generated tokens one API key may use per minute on this gateway; past it Generate is "
                "RESOURCE_EXHAUSTED (0: no limit)")
    reflection: bool = setting(True, help="serve gRPC reflection (open to all: it lists the methods)")
    tls_cert_file: str = tls_cert_setting("the gateway")
    tls_key_file: str = tls_key_setting()
    tls_ca_file: str = tls_ca_setting("clients must present a certificate it signed (empty: no client certificates)")
    max_message_bytes: int = setting(16 * 1024 * 1024, help="largest gRPC message received or sent")
    max_concurrent_streams: int = setting(256, help="concurrent calls one client connection may have open")
    max_buffered_outputs: int = setting(
        4096, help="output records one Generate stream may have waiting for its client; a client that reads slower "
                   "than that is cut off with RESOURCE_EXHAUSTED and its request aborted (bounds gateway memory)")

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)

    @property
    def admission_replica_wait_ms(self) -> int:
        """How long an admission waits for a replica's acknowledgement (0: it does not wait)."""
        on = self.wait_for_replica == "on" or (self.wait_for_replica == "auto" and redis_client.uses_sentinel(self))
        return self.replica_wait_ms if on else 0

    def __post_init__(self) -> None:
        redis_client.validate(self)
        RedisKeys(self.key_prefix)
        self.tls.check(server=True)
        for name, least in (("max_requests_per_key", 0), ("max_tokens_per_key_per_minute", 0),
                            ("max_requests_per_call", 0),
                            ("max_message_bytes", 1), ("max_concurrent_streams", 1), ("max_buffered_outputs", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name}: must be >= {least}, got {getattr(self, name)}")
        if not self.model:
            raise ValueError("model: must be non-empty")
        check_port("port", self.port)
        check_port("http_port", self.http_port, allow_off=True)
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests: must be >= 0, got {self.max_queued_requests}")
        if self.redis_outage_s <= 0:
            raise ValueError(f"redis_outage_s: must be positive, got {self.redis_outage_s}")
        if self.wait_for_replica not in REPLICA_WAIT_MODES:
            raise ValueError(f"wait_for_replica: must be one of {REPLICA_WAIT_MODES}, got {self.wait_for_replica!r}")
        if self.replica_wait_ms < 1:
            raise ValueError(f"replica_wait_ms: must be >= 1, got {self.replica_wait_ms}")
        if self.prompt_bytes_per_token < 1:
            raise ValueError(f"prompt_bytes_per_token: must be >= 1, got {self.prompt_bytes_per_token}")
        if self.output_ttl_s < 1 or self.registry_refresh_s <= 0 or self.read_block_ms < 1:
            raise ValueError("output_ttl_s, registry_refresh_s and read_block_ms must be positive")
