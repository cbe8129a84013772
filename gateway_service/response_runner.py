"""One response's production on this gateway: its generation (:meth:`GenerationService.generate`,
the one generation path) read into events (:class:`~gateway_service.response_events.ResponseBuilder`),
written to its stored log (:class:`~gateway_service.response_store.ResponseStore`; not for
``store: false``) and handed to the local listeners (the stream of the call that created it).

The producer holds the response's lease while it runs, renewing it. It stops producing when:

- the generation ends: the last events and the finished object are written together;
- the gateway drains or loses Redis (UNAVAILABLE): it gives the lease up and writes nothing more,
  so the next reader, on any gateway, takes the production over (the request runs on);
- it loses the lease or cannot write (another gateway took over, the response was deleted): the
  generation is left (aborted unless another gateway reads it);
- the call that created a response that is not in the background ends early (its client left):
  the generation is aborted and the response ends ``cancelled``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import aclosing

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway_service.generation import GenerationService
from gateway_service.messages import GenerateInput
from gateway_service.response_events import TERMINAL, ResponseBuilder
from gateway_service.response_store import LEASE_MS, ResponseStore, StoredResponse
from servicekit.contract.errors import InternalError, NotFoundError, PagedServeError, UnavailableError
from servicekit.contract.step import FinishReason

log = logging.getLogger(__name__)

REDIS_RETRY_S = 0.2
_TERMINAL_EVENTS = frozenset(f"response.{status}" for status in TERMINAL)


def is_terminal(event: dict) -> bool:
    return event["type"] in _TERMINAL_EVENTS


class LeaseLostError(UnavailableError):
    """Another gateway produces the response now (or it was deleted): this one stops."""


class _Handover(Exception):
    """The generation stopped without its response ending (the gateway drains, Redis is away)."""

    def __init__(self, error: PagedServeError) -> None:
        super().__init__(str(error))
        self.error = error


class ResponseRun:
    """Produces one response. ``lease_token``: the lease it holds (None: ``store: false``, nothing
    written); ``meta``: a new response to store once its request is admitted (None: not stored, or
    stored already); ``takeover``: it goes on with a stored response another gateway produced. ``started`` resolves once the first events are out (stored), or with the error
    that refused the request; ``finished`` with the finished object, or the error that stopped it."""

    def __init__(self, service: GenerationService, store: ResponseStore, builder: ResponseBuilder, inp: GenerateInput,
                 *, owner: str, lease_token: str | None, meta: StoredResponse | None, takeover: bool = False,
                 as_sent: Callable[[PagedServeError], PagedServeError] = lambda exc: exc) -> None:
        loop = asyncio.get_running_loop()
        self._service = service
        self._store = store
        self._builder = builder
        self._inp = inp
        self._owner = owner
        self._token = lease_token
        self._meta = meta
        self._takeover = takeover
        self._created = meta is None
        self._as_sent = as_sent
        self.started: asyncio.Future = loop.create_future()
        self.finished: asyncio.Future = loop.create_future()
        self._pending: list[dict] = []  # made, not yet written (or handed out)
        self._final: dict | None = None
        self._wake = asyncio.Event()
        self._listeners: list[asyncio.Queue] = []
        self._stopped: BaseException | None = None
        self.task: asyncio.Task | None = None
        for future in (self.started, self.finished):  # read or not, never "exception was never retrieved"
            future.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def response_id(self) -> str:
        return self._builder.response_id

    def listen(self) -> asyncio.Queue:
        """A queue of the events made from now on, in lists, ending after the terminal event or with
        the error that stopped the run."""
        queue: asyncio.Queue = asyncio.Queue()
        self._listeners.append(queue)
        return queue

    def start(self) -> asyncio.Task:
        self.task = asyncio.create_task(self._run(), name=f"response {self.response_id}")
        return self.task

    # -- the run ----------------------------------------------------------------------------------------

    async def _run(self) -> None:
        helpers = [asyncio.create_task(self._write_loop())]
        if self._token is not None:
            helpers.append(asyncio.create_task(self._renew_loop()))
        try:
            await self._generate()
            await helpers[0]  # until the terminal event is written
        except _Handover as handover:
            self._end(handover.error)
        except asyncio.CancelledError:
            if self._stopped is None:  # the creating call's client left
                if not self._builder.state.ended:
                    self._put(self._builder.cancel())
                self._end(UnavailableError("the response was cancelled: its client left"), flush=True)
                raise
            self._end(self._stopped)  # lease lost or writes failed
        except PagedServeError as exc:  # refused before it was admitted: nothing was stored
            self._end(exc)
        finally:
            for task in helpers:
                task.cancel()

    async def _generate(self) -> None:
        builder = self._builder
        try:
            async with aclosing(self._service.generate(self._inp, owner=self._owner,
                                                       on_admitted=lambda: self._put(builder.start()))) as chunks:
                async for chunk in chunks:
                    cancelled = chunk.finish_reason is FinishReason.ABORT and await self._cancel_requested()
                    self._put(builder.take(chunk, cancelled=cancelled))
        except PagedServeError as exc:
            exc = self._as_sent(exc)
            if isinstance(exc, NotFoundError) and self._takeover:  # too late
                exc = InternalError(f"the generation's tokens left Redis (--output-ttl-s after its last one) before "
                                    f"the response finished, with nobody producing it: {exc}")
            if not self._takeover and builder.state.next_seq == 0:
                raise exc from None  # the creating call answers it: an HTTP error, nothing stored
            if isinstance(exc, UnavailableError) and self._token is not None:
                raise _Handover(exc) from None
            self._put(builder.cancel() if await self._cancel_requested() else builder.fail(exc))

    async def _cancel_requested(self) -> bool:
        return self._token is not None and await self._store.cancel_requested(self.response_id)

    def _put(self, events: list[dict]) -> None:
        if not events:
            return
        self._pending.extend(events)
        if is_terminal(events[-1]):
            self._final = self._builder.state.object()
        self._wake.set()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending:
                    batch = list(self._pending)
                    final = self._final if is_terminal(batch[-1]) else None
                    landed = batch[:await self._write(batch, final)]
                    if not landed:
                        continue  # Redis away: again (a long outage ends the generation, handed over)
                    del self._pending[:len(landed)]
                    for queue in self._listeners:
                        queue.put_nowait(landed)
                    if not self.started.done():
                        self.started.set_result(None)
                    if is_terminal(landed[-1]):
                        self.finished.set_result(self._final)
                        return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - another producer, the response deleted: stop this one
            log.warning("response %s: stopped writing its events (%s)", self.response_id, exc)
            self._stop(exc if isinstance(exc, PagedServeError) else UnavailableError(
                f"Redis refused the response's events ({type(exc).__name__}); read it again later"))

    async def _write(self, batch: list[dict], final: dict | None) -> int:
        """Store ``batch``; returns how many of its events are in the log now (0: Redis did not
        answer, after a pause: the caller tries again)."""
        if self._token is None:
            return len(batch)
        try:
            if not self._created:
                await self._store.create(self._meta, self._token)
                self._created = True
            result = await self._store.append(self.response_id, self._token, batch, final)
            if result == -2:  # an append whose answer was lost landed after all
                landed = await self._store.next_seq(self.response_id) - batch[0]["sequence_number"]
                if 0 < landed <= len(batch):
                    return landed
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("response %s: writing its events failed (%s); retrying", self.response_id, exc)
            await asyncio.sleep(REDIS_RETRY_S)
            return 0
        if result != 1:
            raise LeaseLostError(f"response {self.response_id}: another gateway produces it now, or it was deleted")
        return len(batch)

    async def _renew_loop(self) -> None:
        try:
            while True:
                await asyncio.sleep(LEASE_MS / 3000)
                try:
                    renewed = not self._created or await self._store.renew(self.response_id, self._token)
                except (RedisConnectionError, RedisTimeoutError) as exc:  # the next write tells whether it held
                    log.warning("response %s: renewing its lease failed (%s)", self.response_id, exc)
                    continue
                if not renewed:
                    raise LeaseLostError(f"response {self.response_id}: its lease passed to another gateway, or it "
                                         "was deleted")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._stop(exc if isinstance(exc, PagedServeError) else UnavailableError(f"lease renewal failed: {exc}"))

    def stop(self, error: PagedServeError) -> None:
        """End the run without ending its response (the gateway stops): the next reader takes over."""
        self._stop(error)

    def _stop(self, error: BaseException) -> None:
        """End the run from a helper (its generation is left)."""
        if self.finished.done() or self.task is None or self.task.done():
            return
        self._stopped = error
        self.task.cancel()

    def _end(self, error: BaseException, *, flush: bool = False) -> None:
        """The run ended without (writing) its terminal event: listeners and waiters get ``error``;
        ``flush``: what is pending (a cancellation) is still written, in the background."""
        for queue in self._listeners:
            queue.put_nowait(error)
        if not self.started.done():
            self.started.set_exception(error)
        if not self.finished.done():
            self.finished.set_exception(error)
        if flush and self._token is not None and self._created:
            task = asyncio.get_running_loop().create_task(self._flush())
            _flushes.add(task)
            task.add_done_callback(_flushes.discard)
        elif self._token is not None and self._created:
            task = asyncio.get_running_loop().create_task(self._give_up())
            _flushes.add(task)
            task.add_done_callback(_flushes.discard)

    async def _flush(self) -> None:
        """Write the pending events after whatever of them already reached the log."""
        try:
            written = await self._store.next_seq(self.response_id)
            batch = [e for e in self._pending if e["sequence_number"] >= written]
            if batch and batch[0]["sequence_number"] == written:
                await self._store.append(self.response_id, self._token, batch,
                                         self._final if is_terminal(batch[-1]) else None)
        except Exception as exc:  # noqa: BLE001 - Redis away: the next reader takes the response over
            log.warning("response %s: could not write its end (%s)", self.response_id, exc)

    async def _give_up(self) -> None:
        try:
            await self._store.release(self.response_id, self._token)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            log.debug("response %s: could not release its lease (%s)", self.response_id, exc)


_flushes: set[asyncio.Task] = set()  # end-of-run writes outliving their run
