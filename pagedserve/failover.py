"""Retry and failover of one Generate stream, shared by the blocking and asyncio SDKs.

The SDK assigns every request its id, and counts the output indices it has received. When a call
fails with a transient error (the gateway died, restarted, drains, or lost Redis), the stream is
tried again on the next gateway address (round robin over the client's list), after a backoff:

- nothing received yet: the same request is sent again (same id). If the failed try did reach
  Redis, the gateway answers ALREADY_EXISTS and the stream is resumed from index 0 instead, so the
  request never runs twice;
- tokens received: the stream is resumed by request id with ``resume_from_index`` = the next index
  it expects; gateways send nothing below it, so no token is lost or repeated.

Up to ``retries`` consecutive tries without progress; any received chunk resets the count. A
stream's ``timeout`` bounds all its tries together.
"""

from __future__ import annotations

import time

import grpc

RETRY_BACKOFF_S = 0.2  # doubled after each try without progress
RETRY_BACKOFF_MAX_S = 2.0
# Codes of a call that broke for reasons outside the request: a gateway gone, draining or cut off
# from Redis. A gateway killed mid-stream surfaces as UNAVAILABLE ("Socket closed", "Connection
# reset"), sometimes as INTERNAL / UNKNOWN from the HTTP/2 layer ("RST_STREAM", "Stream removed"), and
# as grpc.aio's INTERNAL "Internal error from Core" when the C core failed an operation of the call
# (the SDK writing the next request of a GenerateMany call into a connection the kill broke).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
TRANSPORT_DETAILS = ("RST_STREAM", "Stream removed", "Socket closed", "Connection reset", "GOAWAY",
                     "Internal error from Core")


def is_transient(code: grpc.StatusCode, details: str) -> bool:
    if code in RETRYABLE:
        return True
    return code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and any(
        marker in (details or "") for marker in TRANSPORT_DETAILS)


class Failover:
    """The retry state of one stream: which address to call, from which index, until when."""

    def __init__(self, request, num_addresses: int, *, retries: int, timeout: float | None) -> None:
        self.request = request  # a GenerateRequest; resume_from_index is set on resumes
        self.address_index = 0  # into the client's address list
        self._num_addresses = max(1, num_addresses)
        self._retries = retries
        self._deadline = time.monotonic() + timeout if timeout is not None else None
        self._attempt = 0
        self._backoff = RETRY_BACKOFF_S
        self.received = False  # at least one chunk arrived (so the request is in Redis)
        self.next_index = 0  # the output index the client expects next

    def remaining(self) -> float | None:
        """Seconds left for the next call (None: no deadline)."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def on_chunk(self, first_index: int, num_tokens: int) -> None:
        self.received = True
        self.next_index = max(self.next_index, first_index + num_tokens)
        self._attempt = 0
        self._backoff = RETRY_BACKOFF_S

    def next_try(self, code: grpc.StatusCode, details: str) -> float | None:
        """After a failed call: the delay before the next try (the request and address are set
        for it), or None when the error is final and must be raised."""
        if code == grpc.StatusCode.ALREADY_EXISTS and self._attempt and not self.received:
            # An earlier try reached Redis before failing: follow that request instead.
            self.request.resume_from_index = 0
            return 0.0
        if not is_transient(code, details) or self._attempt >= self._retries:
            return None
        remaining = self.remaining()
        delay = self._backoff
        if remaining is not None and remaining <= delay:
            return None
        self._attempt += 1
        self._backoff = min(self._backoff * 2, RETRY_BACKOFF_MAX_S)
        if self.received:
            self.request.resume_from_index = self.next_index
        self.address_index = (self.address_index + 1) % self._num_addresses
        return delay


class StreamCall:
    """What a sync and an async stream share: one Generate call at a time, on the gateway the
    :class:`Failover` points at, with the time left of the stream's deadline."""

    def __init__(self, stubs, request, *, timeout: float | None, retries: int, metadata=()) -> None:
        self._stubs = stubs  # one per gateway address, in the client's order
        self._metadata = metadata  # the API key, sent again on every resume (the request belongs to it)
        self._request = request
        self._failover = Failover(request, len(stubs), retries=retries, timeout=timeout)
        self._timeout = timeout
        self._call = None
        self._done = False
        self.request_id = request.request_id

    def _start(self) -> None:
        timeout = self._failover.remaining() if self._timeout is not None else None
        self._call = self._stubs[self._failover.address_index].Generate(
            self._request, timeout=timeout, metadata=self._metadata)


def parse_addresses(address) -> list[str]:
    """``"h1:p1,h2:p2"`` or a sequence of ``host:port`` -> a non-empty list."""
    items = address.split(",") if isinstance(address, str) else list(address)
    addresses = [a.strip() for a in items if a and a.strip()]
    if not addresses:
        raise ValueError("at least one gateway address is needed")
    return addresses
