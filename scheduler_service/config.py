"""The scheduler service's settings: one frozen dataclass, built once in ``main()`` from flags and
``PAGEDSERVE_*`` environment variables. It inherits the concerns it shares (server, metrics,
scheduling, Redis, output streams, the internal link); every field is range-checked by its
declaration."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

from servicekit import redis_client
from servicekit.contract.scheduling import SchedulingConfig
from servicekit.contract.settings import check_settings, project, setting
from servicekit.ports import SCHEDULER_PORT
from servicekit.redis_client import OutputStreamConfig, RedisConfig
from servicekit.service_config import PORT_RANGE, MetricsConfig, ServerConfig
from servicekit.tls import InternalLinkConfig, TlsClientConfig


def default_consumer() -> str:
    return f"scheduler-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(ServerConfig, MetricsConfig, SchedulingConfig, RedisConfig, OutputStreamConfig,
                      TlsClientConfig, InternalLinkConfig):
    """Every knob of a scheduler; each field is also a flag and an env var. The scheduling fields
    apply per worker, within what each worker states (``SchedulingConfig.for_worker``)."""

    port: int = setting(SCHEDULER_PORT, **PORT_RANGE, help="port of the stats/health server (0 = any)")
    workers: tuple[str, ...] = setting(
        (), help="comma-separated worker addresses host:port (empty: find workers in the Redis registry)")
    consumer: str = setting(default_factory=default_consumer, help="consumer name in the Redis group")
    max_queued_per_worker: int = setting(
        0, minimum=0, help="requests pulled per worker beyond its batch (0: as many as max-num-seqs)")
    max_tenant_labels: int = setting(
        32, minimum=0, help="tenants that get their own label in the per-tenant metrics (queue time, tokens); later ones "
                            "count as 'other' (a tenant may be a client's user field: the label set stays bounded)")
    stream_interval: int = setting(
        1, minimum=1, help="publish a running request's tokens once this many wait (its first and last at once): fewer, "
                "larger messages through Redis, gateways and client streams, so less CPU per token where they "
                "share cores with a worker, for burstier streaming (1: every step)")
    async_scheduling: bool = setting(
        True, help="while a decoding batch's step runs, plan and send its next one late in it (vLLM's async "
                   "scheduling; steps with n-gram drafts too: the worker verifies its own in the next): the worker "
                   "does not wait for the round trip through this scheduler; a request that stops on a stop token "
                   "computes a token (and its drafts) that are dropped, one arriving in a step's last fifth waits "
                   "one step more")
    discovery_interval_s: float = setting(
        2.0, above=0, help="registry scan / reconnect period (at most 0.25 s while no worker is driven)")
    poll_block_ms: int = setting(1000, minimum=1, help="longest blocking Redis read (bounds shutdown latency)")
    # Fault tolerance (docs/operations.md).
    lease_ttl_s: float = setting(
        10.0, minimum=0.3, help="lifetime of this scheduler's worker leases and registry entry (renewed every third): a dead "
                   "scheduler's workers are free for others after at most this long")
    reclaim_idle_s: float = setting(
        10.0, minimum=0.5, help="a request entry not refreshed for this long belongs to a dead scheduler and is taken over "
                   "(XAUTOCLAIM); live schedulers refresh theirs every fifth of it")
    max_retries: int = setting(3, minimum=0, help="takeovers of one request before it goes to the dead-letter stream "
                                       "{prefix}dead")

    @property
    def scheduling(self) -> SchedulingConfig:
        """The batching settings, for the scheduler core."""
        return project(self, SchedulingConfig)

    @property
    def reclaim_interval_s(self) -> float:
        """How often held entries are refreshed and idle ones looked for: a fifth of the idle time,
        so a live scheduler refreshes its entries several times before anyone may take them."""
        return self.reclaim_idle_s / 5

    def __post_init__(self) -> None:
        check_settings(self)
        redis_client.validate(self)
        self.tls.check(server=False)
        for address in self.workers:
            if ":" not in address:
                raise ValueError(f"workers: expected host:port, got {address!r}")
