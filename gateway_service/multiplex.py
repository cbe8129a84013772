"""One GenerateMany call: many generations multiplexed over one gRPC stream.

Each generation runs as a Generate call would (:meth:`GenerationService.generate_to`: the same
admission, readers, resumes and aborts) in a task of its own, which sleeps while the request runs:
its chunks are made in the output fanout's task as their records arrive and become events, and
the call sends every event that is ready in one response. With N generations in flight that is
one message per engine step instead of N, and no task wake per chunk — most of the gateway's and
the client's per-token work (and their wake-ups, which preempt the worker on a shared CPU).

Flow control: each generation's chunks waiting for the client are bounded (``max_buffered``); a
generation whose chunk finds no room is aborted and ends RESOURCE_EXHAUSTED, as a Generate call
whose client stops reading is.
"""

from __future__ import annotations

import asyncio
import logging
import math

from gateway_service import convert
from gateway_service.generation import GenerationService
from gateway_service.messages import GenerateChunk
from gateway_service.output_fanout import SlowReaderError
from servicekit.contract.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    PagedServeError,
    UnavailableError,
)
from servicekit.grpc_auth import caller_key_check, caller_key_digest
from servicekit.proto.pb import generation_pb2
from servicekit.proto.status import FIELD_METADATA_KEY
from servicekit.serving import status_for_exception

log = logging.getLogger(__name__)

MAX_EVENTS_PER_RESPONSE = 512  # keeps a response well under the message size limit


class _Ended:
    """Queued when a generation or the request reader ends: the writer checks whether the call is over."""


_ENDED = _Ended()


def error_event(stream_id: int, exc: BaseException) -> generation_pb2.GenerateManyEvent:
    """The event ending ``stream_id`` with ``exc``, carrying the status a Generate call would end with."""
    code, details, trailing = status_for_exception(exc, "a GenerateMany generation")
    field = next((value for key, value in trailing if key == FIELD_METADATA_KEY), "")
    return generation_pb2.GenerateManyEvent(stream_id=stream_id, error_code=code.value[0], error_details=details,
                                            error_field=field)


class GenerateManyCall:
    """The gateway's side of one GenerateMany call; :meth:`responses` is the handler's stream. At
    most ``max_open`` generations run at once; later starts wait for a seat in order."""

    def __init__(self, service: GenerationService, *, max_open: int, max_buffered: int) -> None:
        self._service = service
        self._max_open = max_open
        self._owner = caller_key_digest()  # the call's key owns every request started in it
        self._check_key = caller_key_check()  # and must still be valid when each one starts
        self._tasks: dict[int, asyncio.Task] = {}  # generations running, by stream id
        self._queued: dict[int, tuple] = {}  # started past max_open: (request, deadline), in order
        self._events: asyncio.Queue = asyncio.Queue()  # (stream id, GenerateChunk or ending event) or _ENDED
        self._max_buffered = max(1, max_buffered)
        self._buffered: dict[int, int] = {}  # stream id -> its chunk events queued and not yet sent
        self._reading = True
        self._failure: BaseException | None = None  # a malformed request: fails the whole call

    async def responses(self, request_iterator):
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(request_iterator))
        drain = loop.create_task(self._on_drain())
        try:
            while True:
                item = await self._events.get()
                await asyncio.sleep(0)  # the other generations woken by the same step add theirs
                response = generation_pb2.GenerateManyResponse()
                events = response.events
                while True:
                    if item is _ENDED:
                        if self._failure is not None:
                            raise self._failure
                    else:
                        sid, payload = item
                        if isinstance(payload, GenerateChunk):  # written into the response, not copied
                            convert.chunk_to_pb(payload, events.add(stream_id=sid).response)
                            self._sent_one(sid)
                        else:  # a generation's ending
                            events.append(payload)
                    if len(events) >= MAX_EVENTS_PER_RESPONSE or self._events.empty():
                        break
                    item = self._events.get_nowait()
                if events:
                    yield response
                if not self._tasks and not self._queued and self._events.empty():
                    if not self._reading:
                        return  # the client half-closed and every generation ended
                    if self._service.draining:  # nothing open: end now rather than hold the server's stop
                        raise UnavailableError("the gateway is draining; use another replica")
        finally:
            reader.cancel()
            drain.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            # Each task closes its generation (an abort when nobody else reads it) before the call ends.
            await asyncio.gather(reader, drain, *tasks, return_exceptions=True)

    async def _on_drain(self) -> None:
        await self._service.wait_draining()
        self._events.put_nowait(_ENDED)

    async def _read(self, request_iterator) -> None:
        try:
            async for msg in request_iterator:
                self._handle(msg)
        except PagedServeError as exc:
            self._failure = exc
        except Exception as exc:  # a message that did not decode
            log.info("GenerateMany: undecodable message (%s); ending the call", type(exc).__name__)
            self._failure = InvalidArgumentError("request", "a GenerateMany message did not decode as "
                                                            "GenerateManyRequest")
        finally:
            self._reading = False
            self._events.put_nowait(_ENDED)

    def _handle(self, msg: generation_pb2.GenerateManyRequest) -> None:
        action = msg.WhichOneof("action")
        sid = msg.stream_id
        if action == "cancel":
            task = self._tasks.get(sid)
            if task is not None:
                task.cancel()
            elif self._queued.pop(sid, None) is not None:
                self._events.put_nowait(_ENDED)  # it may have been the last thing open
            return
        if action != "start":
            raise InvalidArgumentError("stream_id", f"stream {sid}: a message must start or cancel a generation")
        if sid in self._tasks or sid in self._queued:
            raise InvalidArgumentError("stream_id", f"stream {sid} is already open in this call")
        try:
            self._check_key()
        except PagedServeError as exc:  # the key was revoked since the call began
            self._events.put_nowait((sid, error_event(sid, exc)))
            return
        timeout = msg.timeout_s
        if not math.isfinite(timeout) or timeout < 0:
            self._events.put_nowait((sid, error_event(sid, InvalidArgumentError(
                "timeout_s", f"must be a finite number of seconds >= 0, got {timeout}"))))
            return
        deadline = asyncio.get_running_loop().time() + timeout if timeout else None
        if len(self._tasks) >= self._max_open:
            # Past --max-concurrent-streams it waits for a seat, as a call past the HTTP/2 limit does.
            self._queued[sid] = (msg.start, deadline)
        else:
            self._launch(sid, msg.start, deadline)

    def _launch(self, sid: int, request: generation_pb2.GenerateRequest, deadline: float | None) -> None:
        self._tasks[sid] = asyncio.get_running_loop().create_task(self._generate(sid, request, deadline))

    def _launch_queued(self) -> None:
        while self._queued and len(self._tasks) < self._max_open:
            sid = next(iter(self._queued))
            self._launch(sid, *self._queued.pop(sid))

    async def _generate(self, sid: int, request: generation_pb2.GenerateRequest, deadline_at: float | None) -> None:
        deadline = asyncio.timeout_at(deadline_at)
        try:
            async with deadline:
                timeout = None if deadline_at is None else max(1e-3, deadline_at - asyncio.get_running_loop().time())
                await self._service.generate_to(convert.generate_input_from_pb(request, self._service.sampling_defaults),
                                                self._emitter(sid),
                                                timeout_s=timeout, owner=self._owner)
        except asyncio.CancelledError:
            pass  # cancelled by its client, or the call ends: nobody waits for an event
        except TimeoutError as exc:
            self._end_with(sid, DeadlineExceededError("Deadline Exceeded") if deadline.expired() else exc)
        except Exception as exc:
            self._end_with(sid, exc)
        finally:
            self._tasks.pop(sid, None)
            self._launch_queued()
            self._events.put_nowait(_ENDED)

    def _emitter(self, sid: int):
        """What ``sid``'s chunks go through (in the output fanout's task): into the next response."""
        def emit(chunk) -> None:
            waiting = self._buffered.get(sid, 0)
            if waiting >= self._max_buffered:
                raise SlowReaderError(f"the client fell {waiting} chunks behind (limit {self._max_buffered}, "
                                      "--max-buffered-outputs); the request was aborted")
            self._buffered[sid] = waiting + 1
            self._events.put_nowait((sid, chunk))
        return emit

    def _sent_one(self, sid: int) -> None:
        waiting = self._buffered[sid] - 1
        if waiting:
            self._buffered[sid] = waiting
        else:
            del self._buffered[sid]

    def _end_with(self, sid: int, exc: BaseException) -> None:
        self._events.put_nowait((sid, error_event(sid, exc)))
