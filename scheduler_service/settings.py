"""The scheduler service's settings: one frozen dataclass, built once in ``main()`` from flags and
``PAGEDSERVE_*`` environment variables (STYLE.md habit 4)."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from pagedserve.redis_keys import RedisKeys
from scheduler_service.core.config import DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD, POLICIES

DEFAULT_PORT = 50052


def default_consumer() -> str:
    return f"scheduler-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "ps:"
    workers: tuple[str, ...] = ()  # worker addresses; empty = find them in the Redis registry
    host: str = "127.0.0.1"  # the admin (stats + health) server
    port: int = DEFAULT_PORT
    consumer: str = field(default_factory=default_consumer)  # name in the consumer group
    # Batching, per worker (0 = the worker's own limit; never more than it).
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    long_prefill_token_threshold: int = 0
    shared_prefill_token_threshold: int = DEFAULT_SHARED_PREFILL_TOKEN_THRESHOLD  # while others wait/run
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    # Requests pulled from Redis per worker beyond its running batch (0 = as many as max_num_seqs).
    max_queued_per_worker: int = 0
    output_ttl_s: int = 600  # output streams expire this long after their last entry
    discovery_interval_s: float = 2.0  # registry scan / reconnect period
    poll_block_ms: int = 1000  # longest blocking Redis read (bounds shutdown latency)
    drain_grace_s: float = 30.0
    # Fault tolerance (README "Scaling and fault tolerance").
    lease_ttl_s: float = 10.0  # worker leases and this scheduler's registry entry; renewed every third
    reclaim_idle_s: float = 10.0  # a request entry idle this long belongs to a dead scheduler: take it over
    max_retries: int = 3  # takeovers of one request before it is dead-lettered

    @property
    def reclaim_interval_s(self) -> float:
        """How often held entries are refreshed and idle ones looked for: a fifth of the idle time,
        so a live scheduler refreshes its entries several times before anyone may take them."""
        return self.reclaim_idle_s / 5

    def __post_init__(self) -> None:
        RedisKeys(self.key_prefix)
        for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                     "shared_prefill_token_threshold", "max_queued_per_worker"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {POLICIES}, got {self.policy!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65536), got {self.port}")
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
