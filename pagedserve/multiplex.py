"""The asyncio SDK's streams multiplexed over GenerateMany calls, one call per gateway carrying every
stream the client has open there (up to MAX_STREAMS_PER_CALL; then another call).

A :class:`MultiplexedStream` stands in for a Generate call: ``read()`` returns the next
``GenerateResponse`` or raises ``grpc.aio.AioRpcError`` with the code a Generate call would have
ended with, and ``cancel()`` cancels it; so retries and failover (:mod:`pagedserve.failover`) work
on it unchanged. When the GenerateMany call itself breaks (the gateway died or stops), every stream
in it fails with that call's status and is resumed like a broken Generate call.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from servicekit.proto.pb import generation_pb2
from servicekit.proto.status import FIELD_METADATA_KEY

log = logging.getLogger(__name__)

MAX_STREAMS_PER_CALL = 256  # a gateway's default --max-concurrent-streams

_END = object()  # the outgoing queue's close marker
CLOSE_WAIT_S = 1.0  # a closing client waits this long for the gateway to end a call


def stream_error(code: grpc.StatusCode, details: str, field: str = "") -> grpc.aio.AioRpcError:
    """A failed stream as the failed Generate call it stands for."""
    trailing = grpc.aio.Metadata((FIELD_METADATA_KEY, field)) if field else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class MultiplexedStream:
    """One generation of a :class:`GenerateManyCall`, read like a Generate call."""

    def __init__(self, call: GenerateManyCall, stream_id: int, timeout: float | None) -> None:
        self._call = call
        self._id = stream_id
        self.inbox: asyncio.Queue = asyncio.Queue()
        self._over = False
        # The gateway ends a generation at its deadline too; the client's holds anyway (one timer, not one per read).
        self._timer = None if timeout is None else asyncio.get_running_loop().call_later(timeout, self._expire)

    async def read(self):
        if self._over and self.inbox.empty():
            return grpc.aio.EOF
        item = await self.inbox.get()
        if isinstance(item, grpc.aio.AioRpcError):
            self._end()
            raise item
        if item.finish_reason:
            self._end()
        return item

    def cancel(self) -> None:
        if not self._over:
            self._call.cancel_stream(self._id)
        self._end()
        self.inbox = asyncio.Queue()  # nothing more is read

    def _end(self) -> None:
        self._over = True
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        if not self._over:
            self._call.cancel_stream(self._id)
            self._end()
            self.inbox.put_nowait(stream_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))


class GenerateManyCall:
    """One GenerateMany call to a gateway and the streams open in it."""

    def __init__(self, stub, metadata) -> None:
        self._outgoing: asyncio.Queue = asyncio.Queue()
        self._streams: dict[int, MultiplexedStream] = {}
        self._ids = itertools.count(1)
        self.broken: grpc.aio.AioRpcError | None = None
        self._call = stub.GenerateMany(self._requests(), metadata=metadata)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def usable(self) -> bool:
        return self.broken is None and len(self._streams) < MAX_STREAMS_PER_CALL

    def open(self, request: generation_pb2.GenerateRequest, timeout: float | None) -> MultiplexedStream:
        stream_id = next(self._ids)
        stream = MultiplexedStream(self, stream_id, timeout)
        self._streams[stream_id] = stream
        self._outgoing.put_nowait(generation_pb2.GenerateManyRequest(
            stream_id=stream_id, start=request, timeout_s=timeout or 0.0))
        return stream

    def cancel_stream(self, stream_id: int) -> None:
        if self._streams.pop(stream_id, None) is not None and self.broken is None:
            self._outgoing.put_nowait(generation_pb2.GenerateManyRequest(stream_id=stream_id, cancel=True))

    async def _requests(self):
        while True:
            msg = await self._outgoing.get()
            if msg is _END:
                return
            yield msg

    async def _read(self) -> None:
        error = stream_error(grpc.StatusCode.UNAVAILABLE, "the gateway ended the GenerateMany call")
        try:
            async for response in self._call:
                for event in response.events:
                    stream = self._streams.get(event.stream_id)
                    if stream is None:
                        continue  # cancelled here meanwhile
                    if event.error_code:
                        del self._streams[event.stream_id]
                        stream.inbox.put_nowait(stream_error(
                            _CODES.get(event.error_code, grpc.StatusCode.UNKNOWN), event.error_details,
                            event.error_field))
                        continue
                    if event.response.finish_reason:
                        del self._streams[event.stream_id]
                    stream.inbox.put_nowait(event.response)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = stream_error(grpc.StatusCode.CANCELLED, "the client closed")
            raise
        finally:
            self.broken = error
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                stream.inbox.put_nowait(error)
            if streams and error.code() != grpc.StatusCode.CANCELLED:
                log.info("GenerateMany call broke (%s: %s); %d streams fail over", error.code().name,
                         error.details(), len(streams))

    async def close(self) -> None:
        """Half-close: the gateway ends the call once nothing is open in it; streams still open
        are cancelled (as is a call that has not ended within CLOSE_WAIT_S)."""
        for stream_id in list(self._streams):
            self.cancel_stream(stream_id)
        self._outgoing.put_nowait(_END)
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), CLOSE_WAIT_S)
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class GenerateManyPool:
    """The client's GenerateMany calls, per gateway address."""

    def __init__(self, stubs, metadata) -> None:
        self._stubs = stubs
        self._metadata = metadata
        self._calls: list[list[GenerateManyCall]] = [[] for _ in stubs]

    def open(self, address_index: int, request, timeout: float | None) -> MultiplexedStream:
        """A stream on the gateway at ``address_index``."""
        calls = self._calls[address_index]
        calls[:] = [c for c in calls if c.broken is None]
        call = next((c for c in calls if c.usable), None)
        if call is None:
            call = GenerateManyCall(self._stubs[address_index], self._metadata)
            calls.append(call)
        return call.open(request, timeout)

    async def close(self) -> None:
        calls = [c for per_address in self._calls for c in per_address]
        self._calls = [[] for _ in self._stubs]
        await asyncio.gather(*(c.close() for c in calls), return_exceptions=True)
