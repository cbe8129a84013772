"""The engine loop of one worker (DESIGN.md "The path of one request"):

    admit new requests / apply aborts → schedule() → Step → update_from_output() → publish

One :class:`WorkerEngine` per worker: its own Scheduler core (so its own block pool, decision 4)
and its own Step stream. Aborts and new requests arriving while a step is in flight are applied
between steps, so an aborted request's blocks are free by the end of the step in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from scheduler_service import convert
from scheduler_service.convert import WorkerDescription
from scheduler_service.core.errors import InvalidParameterError
from scheduler_service.core.outputs import EngineCoreOutput, FinishReason
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.redis_queue import RedisQueue
from scheduler_service.worker_client import WorkerClient, WorkerLostError

log = logging.getLogger(__name__)


class WorkerEngine:
    """Drives one worker.

    Invariant: ``_entry_ids`` holds exactly the requests handed to this engine and not yet
    published as finished (in the inbox or live in the core); each is XACKed once, when its
    finishing record is published.
    """

    def __init__(self, client: WorkerClient, description: WorkerDescription, core: Scheduler,
                 queue: RedisQueue, *, max_queued: int,
                 on_finished: Callable[[int, int], None]) -> None:
        self.client = client
        self.address = client.address
        self.description = description
        self.core = core
        self._queue = queue
        self._on_finished = on_finished  # (num finished, num aborted) after each publish
        self._capacity = core.config.max_num_seqs + max_queued  # requests held at most
        self._inbox: list[Request] = []
        self._entry_ids: dict[str, str] = {}  # request id -> its request-stream entry id
        self._aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._publishing: asyncio.Task | None = None  # the pipeline in flight
        self.accepting = True  # False while the worker reports NOT_SERVING
        self.connected = True  # False once the Step stream failed
        self.num_steps = 0

    # -- called by the service ------------------------------------------------------------------------

    @property
    def load(self) -> int:
        return len(self._entry_ids)

    @property
    def room(self) -> int:
        """New requests this engine takes now (0 while its worker drains or is lost)."""
        if not (self.accepting and self.connected):
            return 0
        return max(0, self._capacity - len(self._entry_ids))

    def fits(self, request: Request) -> bool:
        return request.num_prompt_tokens + request.max_tokens <= self.description.info.max_model_len

    def owns(self, request_id: str) -> bool:
        return request_id in self._entry_ids

    def submit(self, request: Request, entry_id: str) -> None:
        self._entry_ids[request.request_id] = entry_id
        self._inbox.append(request)
        self._idle.clear()
        self._wake.set()

    def abort(self, request_id: str) -> None:
        if request_id in self._entry_ids:
            self._aborts.add(request_id)
            self._wake.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    # -- the loop -------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Step until cancelled or the worker is lost (then every held request is failed)."""
        core = self.core
        try:
            while True:
                # Cleared before admitting: a submit() during the awaits below sets it again, so
                # the wait cannot miss it.
                self._wake.clear()
                await self._admit_and_abort()
                if not core.has_unfinished_requests() and not core.finished_req_ids:
                    if not self._inbox and not self._aborts:
                        await self._wake.wait()
                    continue
                scheduler_output = core.schedule()
                if (scheduler_output.is_empty and not scheduler_output.finished_req_ids
                        and not scheduler_output.preempted_req_ids):
                    # Nothing can run until something changes (defensive: the core admits any
                    # request that fits an empty pool).
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.01)
                    except asyncio.TimeoutError:
                        pass
                    continue
                runner_output = await self.client.step(scheduler_output)
                self.num_steps += 1
                await self._publish(core.update_from_output(scheduler_output, runner_output))
        except WorkerLostError as exc:
            self.connected = False
            log.error("%s; failing its %d requests", exc, len(self._entry_ids))
            await self._fail_all(f"worker failed: {exc}")
        except Exception:
            # A bug or Redis failure: fail what we hold rather than leave clients waiting; the
            # service reconnects the worker with a fresh core.
            self.connected = False
            log.exception("engine of %s failed; failing its %d requests", self.address, len(self._entry_ids))
            await self._fail_all("scheduler engine failed")
            raise

    async def _fail_all(self, message: str) -> None:
        self._inbox.clear()
        try:
            await self._publish([], [(rid, "", message) for rid in list(self._entry_ids)])
            if self._publishing is not None:
                await self._publishing
        except Exception as exc:
            log.error("could not publish the failure of %d requests: %s", len(self._entry_ids), exc)

    async def _admit_and_abort(self) -> None:
        outputs: list[EngineCoreOutput] = []
        errors: list[tuple[str, str, str]] = []
        if self._inbox:
            inbox, self._inbox = self._inbox, []
            for request in inbox:
                try:
                    self.core.add_request(request)
                except InvalidParameterError as exc:
                    errors.append((request.request_id, exc.field, exc.message))
        if self._aborts:
            aborts, self._aborts = self._aborts, set()
            outputs = self.core.abort(aborts)
        if outputs or errors:
            await self._publish(outputs, errors)

    async def _publish(self, outputs: list[EngineCoreOutput],
                       errors: list[tuple[str, str, str]] = ()) -> None:
        """One Redis pipeline: every output record, then XACK + delete of the finished requests.

        The pipeline runs while the next step computes; pipelines go out one at a time, in step
        order (each waits for the previous one), so a request's records stay in index order."""
        records = [(o.request_id, convert.engine_output_to_record(o)) for o in outputs]
        finished_entries = []
        num_aborted = 0
        for o in outputs:
            if o.finish_reason is not None and o.request_id in self._entry_ids:
                finished_entries.append(self._entry_ids.pop(o.request_id))
                num_aborted += o.finish_reason is FinishReason.ABORT
        for rid, field, message in errors:
            records.append((rid, convert.error_record(field, message)))
            if rid in self._entry_ids:
                finished_entries.append(self._entry_ids.pop(rid))
                num_aborted += 1
        if self._publishing is not None:
            await self._publishing  # re-raises a failed previous publish
        self._publishing = asyncio.create_task(self._send(records, finished_entries, num_aborted))

    async def _send(self, records: list[tuple[str, bytes]], finished_entries: list[str], num_aborted: int) -> None:
        await self._queue.publish(records, finished_entries)
        if finished_entries:
            if not self._entry_ids:
                self._idle.set()
            self._on_finished(len(finished_entries), num_aborted)

    async def close(self) -> None:
        if self._publishing is not None:
            await asyncio.gather(self._publishing, return_exceptions=True)
        await self.client.close()
