"""The scheduler service's settings: one frozen dataclass, built once in ``main()`` from flags and
``PAGEDSERVE_*`` environment variables (STYLE.md habit 4)."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

from scheduler_service.core.config import DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD, POLICIES
from servicekit import redis_client
from servicekit.flags import (
    check_port,
    drain_grace_setting,
    internal_token_setting,
    key_prefix_setting,
    metrics_port_setting,
    output_ttl_setting,
    redis_url_setting,
    setting,
    tls_ca_setting,
    tls_cert_setting,
    tls_key_setting,
)
from servicekit.ports import SCHEDULER_PORT
from servicekit.redis_keys import RedisKeys
from servicekit.tls import TlsFiles

DEFAULT_PORT = SCHEDULER_PORT


def default_consumer() -> str:
    return f"scheduler-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """Every knob of a scheduler; each field declared with ``setting`` is also a flag and an env var."""

    workers: tuple[str, ...] = setting(
        (), help="comma-separated worker addresses host:port (empty: find workers in the Redis registry)")
    host: str = setting("127.0.0.1", help="interface of the stats/health server")
    port: int = setting(DEFAULT_PORT, help="port of the stats/health server (0 = any)")
    metrics_port: int = metrics_port_setting()
    consumer: str = setting(default_factory=default_consumer, help="consumer name in the Redis group")
    redis_url: str = redis_url_setting()
    redis_sentinels: tuple[str, ...] = redis_client.redis_sentinels_setting()
    redis_master_name: str = redis_client.redis_master_name_setting()
    redis_sentinel_password: str = redis_client.redis_sentinel_password_setting()
    key_prefix: str = key_prefix_setting()
    drain_grace_s: float = drain_grace_setting()
    # Batching, per worker (0 = the worker's own limit; never more than it).
    max_num_seqs: int = setting(0, help="running requests per worker (0: the worker's batch size; never more)")
    max_num_batched_tokens: int = setting(0, help="token budget of one step (0: the worker's limit; never more)")
    long_prefill_token_threshold: int = setting(0, help="cap of one prefill chunk (0: off)")
    shared_prefill_token_threshold: int = setting(
        DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD,
        help="cap of one prefill chunk while other requests wait or run, for fair time to first token and "
             "steady decoding (0: off)")
    prefill_chunk_attention_limit: int = setting(
        -1, help="key positions one prefill chunk attends in all (tokens x context): a long prompt's later chunks "
                 "shrink so a step stays short at any context (-1: what each worker states, 1048576 on a CPU, "
                 "none on a GPU; 0: off)")
    enable_chunked_prefill: bool = setting(True, help="split long prompts over steps")
    enable_prefix_caching: bool = setting(True, help="reuse KV blocks of shared prefixes")
    policy: str = setting("fcfs", choices=POLICIES, help="waiting-queue order")
    max_queued_per_worker: int = setting(
        0, help="requests pulled per worker beyond its batch (0: as many as max-num-seqs)")
    stream_interval: int = setting(
        1, help="publish a running request's tokens once this many wait (its first and last at once): fewer, "
                "larger messages through Redis, gateways and client streams, so less CPU per token where they "
                "share cores with a worker, for burstier streaming (1: every step)")
    async_scheduling: bool = setting(
        True, help="while a decoding batch's step runs, plan and send its next one late in it (vLLM's async "
                   "scheduling): the worker does not wait for the round trip through this scheduler; a request that "
                   "stops on a stop token computes one token that is dropped, one arriving in a step's last fifth "
                   "waits one step more")
    output_ttl_s: int = output_ttl_setting()
    discovery_interval_s: float = setting(2.0, help="registry scan / reconnect period")
    poll_block_ms: int = setting(1000, help="longest blocking Redis read (bounds shutdown latency)")
    # Fault tolerance (README "Scaling and fault tolerance").
    lease_ttl_s: float = setting(
        10.0, help="lifetime of this scheduler's worker leases and registry entry (renewed every third): a dead "
                   "scheduler's workers are free for others after at most this long")
    reclaim_idle_s: float = setting(
        10.0, help="a request entry not refreshed for this long belongs to a dead scheduler and is taken over "
                   "(XAUTOCLAIM); live schedulers refresh theirs every fifth of it")
    max_retries: int = setting(3, help="takeovers of one request before it goes to the dead-letter stream "
                                       "{prefix}dead")

    # Security (README "Security"): mutual TLS to the workers and on the admin server, and/or a token.
    tls_cert_file: str = tls_cert_setting("the scheduler to workers (and on its admin server)")
    tls_key_file: str = tls_key_setting()
    tls_ca_file: str = tls_ca_setting("workers' certificates must be signed by it (and, with --tls-cert-file, admin "
                                      "clients' too); setting it turns TLS to workers on")
    tls_server_name: str = setting("", help="name the workers' certificates carry, when it is not the address dialed "
                                            "(workers register their IPs)")
    internal_token: str = internal_token_setting()

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_ca_file, self.tls_server_name)

    @property
    def reclaim_interval_s(self) -> float:
        """How often held entries are refreshed and idle ones looked for: a fifth of the idle time,
        so a live scheduler refreshes its entries several times before anyone may take them."""
        return self.reclaim_idle_s / 5

    def __post_init__(self) -> None:
        redis_client.validate(self)
        RedisKeys(self.key_prefix)
        self.tls.check(server=False)
        for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                     "shared_prefill_token_threshold", "max_queued_per_worker"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.prefill_chunk_attention_limit < -1:
            raise ValueError(f"prefill_chunk_attention_limit: must be -1 (each worker's), 0 (off) or positive, "
                             f"got {self.prefill_chunk_attention_limit}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}, got {self.policy!r}")
        check_port("port", self.port)
        check_port("metrics_port", self.metrics_port, allow_off=True)
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval: must be >= 1, got {self.stream_interval}")
        if self.output_ttl_s < 1:
            raise ValueError(f"output_ttl_s: must be >= 1, got {self.output_ttl_s}")
        if self.discovery_interval_s <= 0 or self.poll_block_ms < 1:
            raise ValueError("discovery_interval_s and poll_block_ms must be positive")
        if self.lease_ttl_s < 0.3:
            raise ValueError(f"lease_ttl_s: must be >= 0.3, got {self.lease_ttl_s}")
        if self.reclaim_idle_s < 0.5:
            raise ValueError(f"reclaim_idle_s: must be >= 0.5, got {self.reclaim_idle_s}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {self.max_retries}")
        for address in self.workers:
            if ":" not in address:
                raise ValueError(f"workers: expected host:port, got {address!r}")
