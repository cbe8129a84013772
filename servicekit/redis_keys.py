"""The Redis key schema every service shares (DESIGN.md "The path of one request").

All keys live under one configurable prefix (default ``ps:``) so two stacks can share a Redis.
The record formats are in ``protos/pagedserve/v1/queue.proto``.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "ps:"
SCHEDULER_GROUP = "schedulers"  # the consumer group of the request stream


@dataclass(frozen=True, slots=True)
class RedisKeys:
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"key prefix must be non-empty without spaces, got {self.prefix!r}")

    @property
    def requests(self) -> str:
        """Stream of EngineRequest records; consumer group ``schedulers``."""
        return f"{self.prefix}requests"

    def output(self, request_id: str) -> str:
        """Stream of EngineOutput records of one request (expires after its last entry)."""
        return f"{self.prefix}out:{request_id}"

    def readers(self, request_id: str) -> str:
        """Counter of the Generate calls reading one request's output stream, on any gateway; the
        last to leave before the request finished aborts it (expires with the output TTL)."""
        return f"{self.prefix}readers:{request_id}"

    @property
    def aborts(self) -> str:
        """Capped stream of abort notices; every scheduler reads all of it."""
        return f"{self.prefix}aborts"

    def worker(self, worker_id: str) -> str:
        """Hash describing one live worker (expires unless its heartbeat refreshes it)."""
        return f"{self.prefix}workers:{worker_id}"

    @property
    def worker_pattern(self) -> str:
        return f"{self.prefix}workers:*"

    def lease(self, worker_id: str) -> str:
        """String holding the consumer name of the one scheduler that drives this worker (SET NX PX,
        renewed by its holder; expires when the holder stops renewing)."""
        return f"{self.prefix}lease:{worker_id}"

    def scheduler(self, consumer: str) -> str:
        """Hash describing one live scheduler (expires unless its heartbeat refreshes it)."""
        return f"{self.prefix}schedulers:{consumer}"

    @property
    def scheduler_pattern(self) -> str:
        return f"{self.prefix}schedulers:*"

    @property
    def dead_letters(self) -> str:
        """Capped stream of requests given up after too many attempts: fields "request_id", "data"
        (the EngineRequest), "deliveries" and "reason"."""
        return f"{self.prefix}dead"

    def gateway_wake(self, gateway_id: str) -> str:
        """A gateway's own small stream, written to interrupt its blocking XREAD when it adds a key."""
        return f"{self.prefix}gw:{gateway_id}:wake"

    def gateway_live(self, gateway_id: str) -> str:
        """A gateway's live stream: with each step's records for the requests it admitted, the
        schedulers append one entry here (fields ``"{output stream} {entry id}"`` -> the record), so
        the gateway reads one stream per step however many requests it streams. Trimmed by the
        gateway as it reads; expires after its last entry."""
        return f"{self.prefix}gw:{gateway_id}:live"


async def ensure_request_group(redis, keys: RedisKeys) -> None:
    """Create the request stream and its consumer group if missing (idempotent; gateways and
    schedulers both call it at start, whichever comes first)."""
    from redis.exceptions import ResponseError

    try:
        await redis.xgroup_create(keys.requests, SCHEDULER_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
