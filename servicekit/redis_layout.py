"""The Redis layout every service shares (docs/architecture.md, "The path of one request"): the keys, the
field names of stream entries and the consumer group, each spelled here once. The Lua scripts of
the admission (gateway), the output fan-out and the intake (scheduler) have the field names
formatted into their text at import.

All keys live under one configurable prefix (default ``ps:``) so two stacks can share a Redis.
The records in ``DATA_FIELD`` are queue.proto's (``servicekit.proto.queue``); that file's header
describes this layout for readers of the protos.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "ps:"
SCHEDULER_GROUP = "schedulers"  # the consumer group of the request stream

# -- field names of stream entries ---------------------------------------------------------------
DATA_FIELD = "data"  # a record: EngineRequest (request and dead-letter entries), EngineOutput (output entries)
REQUEST_ID_FIELD = "request_id"  # request, abort and dead-letter entries
LIVE_FIELD = "live"  # request entry: the admitting gateway's live stream, where its records go too
# The admission marker (an output stream's first entry, empty DATA_FIELD): what a resume must match
# and the API key that owns the request.
PROMPT_DIGEST_FIELD = "prompt_digest"
PARAMS_DIGEST_FIELD = "params_digest"
OWNER_FIELD = "owner"
WAKE_FIELD = "w"  # a wake stream entry's one field (its value does not matter)
# Dead-letter entries, beside REQUEST_ID_FIELD and DATA_FIELD.
REASON_FIELD = "reason"
MODEL_LIMITS_TTL_S = 30 * 24 * 3600  # a model's last-seen limits outlive a month without workers
DELIVERIES_FIELD = "deliveries"
CONSUMER_FIELD = "consumer"
# A live stream entry has one field per record: "{output stream}{LIVE_SEPARATOR}{entry id there}".
LIVE_SEPARATOR = " "


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

    def model_limits(self, model: str) -> str:
        """String: the model's limits (JSON) as its workers last registered them, written by the
        gateways that saw them; what a gateway admits by while none is registered (scale from
        zero). Expires :data:`MODEL_LIMITS_TTL_S` after the last worker was seen."""
        return f"{self.prefix}model-limits:{model}"

    def scheduler(self, consumer: str) -> str:
        """Hash describing one live scheduler (expires unless its heartbeat refreshes it)."""
        return f"{self.prefix}schedulers:{consumer}"

    @property
    def scheduler_pattern(self) -> str:
        return f"{self.prefix}schedulers:*"

    @property
    def dead_letters(self) -> str:
        """Capped stream of requests given up after too many attempts: fields ``REQUEST_ID_FIELD``,
        ``DATA_FIELD`` (the EngineRequest), ``REASON_FIELD``, ``DELIVERIES_FIELD`` and
        ``CONSUMER_FIELD``."""
        return f"{self.prefix}dead"

    def gateway_wake(self, gateway_id: str) -> str:
        """A gateway's own small stream, written to interrupt its blocking XREAD when it adds a key."""
        return f"{self.prefix}gw:{gateway_id}:wake"

    def gateway_live(self, gateway_id: str) -> str:
        """A gateway's live stream: with each step's records for the requests it admitted, the
        schedulers append one entry here (fields ``"{output stream} {entry id}"`` -> the record,
        ``LIVE_SEPARATOR`` between), so the gateway reads one stream per step however many requests
        it streams. Trimmed by the gateway as it reads; expires after its last entry."""
        return f"{self.prefix}gw:{gateway_id}:live"

    # A stored response of the Responses API (gateway_service.response_store): all four keys expire
    # after the gateway's --response-ttl-s (the lease after its own few seconds).

    def response(self, response_id: str) -> str:
        """String: the response object as JSON, as created and then as finished."""
        return f"{self.prefix}resp:{response_id}"

    def response_meta(self, response_id: str) -> str:
        """Hash of what any gateway needs to serve the response: the owner's key digest, the
        request id, the request as the chat path takes it, the input and conversation items, and
        ``cancelled`` once a cancel was asked."""
        return f"{self.prefix}resp:{response_id}:meta"

    def response_events(self, response_id: str) -> str:
        """Stream of the response's events (``DATA_FIELD``: one event as JSON), entry id
        ``0-{sequence_number + 1}``: the one log every reader replays, written by its producer."""
        return f"{self.prefix}resp:{response_id}:events"

    def response_lease(self, response_id: str) -> str:
        """String naming the one gateway producing the response's events (SET NX PX, renewed; a
        reader that finds it gone takes the production over)."""
        return f"{self.prefix}resp:{response_id}:lease"


async def ensure_request_group(redis, keys: RedisKeys) -> None:
    """Create the request stream and its consumer group if missing (idempotent; gateways and
    schedulers both call it at start, whichever comes first)."""
    from redis.exceptions import ResponseError

    try:
        await redis.xgroup_create(keys.requests, SCHEDULER_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
