"""The worker's gRPC service: Describe, the Step bidirectional stream, and Reset, around a model
runner (docs/architecture.md, decisions 3 and 10).

The runner is blocking torch code; every call into it runs on one dedicated thread, so the event
loop keeps answering health checks and moving stream messages during a long forward pass. One
Step stream at a time: the worker's persistent batch mirrors exactly one scheduler's state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

from servicekit.contract.errors import FailedPreconditionError
from servicekit.contract.step import ModelRunnerOutput, SchedulerOutput
from servicekit.contract.worker import WorkerDescription
from servicekit.grpc_auth import internal_interceptors
from servicekit.proto import step
from servicekit.proto.pb import WORKER_SERVICE, worker_pb2, worker_pb2_grpc
from servicekit.serving import ServerLifecycle

log = logging.getLogger(__name__)


class StepRunner(Protocol):
    """What the service needs of a model runner (worker_service.model_runner.ModelRunner)."""

    @property
    def info(self) -> WorkerDescription: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class StepSkippedError(RuntimeError):
    """A step not run: one before it on the same stream failed, or the stream ended."""


class _StepStream:
    """One Step stream's steps handed to the runner thread, in order (see ``WorkerServicer._read_steps``)."""

    __slots__ = ("ended", "steps")

    def __init__(self) -> None:
        self.steps: asyncio.Queue = asyncio.Queue()
        self.ended = False  # set on the runner thread by a failed step, or by the handler as it ends


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Invariant: ``_live`` is the set of request ids the runner holds (added by new requests,
    removed by finished / preempted ids and by drops); it is empty whenever no Step stream is open
    and the last drop has run."""

    def __init__(self, runner: StepRunner, *, worker_id: str, max_num_seqs: int,
                 max_num_batched_tokens: int, step_delay_s: float = 0.0,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self._runner = runner
        self._step_delay_s = step_delay_s  # testing knob: throttles generation (chaos tests)
        self._info = runner.info
        self._worker_id = worker_id
        self._max_num_seqs = max_num_seqs
        self._max_num_batched_tokens = max_num_batched_tokens
        # The one thread the runner runs on (the one that loaded it, when given: see WorkerApp.start).
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-runner")
        self._live: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stream_open = False
        self.stopping = False  # set when the server stops: a stream broken by that is no error
        self.num_steps = 0

    @property
    def num_held(self) -> int:
        """Requests the runner holds now."""
        return len(self._live)

    # -- rpcs -----------------------------------------------------------------------------------------

    async def Describe(self, request, context):
        return step.worker_description_to_pb(replace(
            self._info, worker_id=self._worker_id, max_num_seqs=self._max_num_seqs,
            max_num_batched_tokens=self._max_num_batched_tokens))

    async def Step(self, request_iterator, context):
        if self._stream_open:
            raise FailedPreconditionError("this worker is already driven by a scheduler (one Step stream at a time)")
        self._stream_open = True
        peer = context.peer()
        log.info("scheduler %s connected", peer)
        stream = _StepStream()
        reader = asyncio.get_running_loop().create_task(self._read_steps(request_iterator, stream))
        try:
            while (item := await stream.steps.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                step_id, future = item
                output, seconds = await asyncio.wrap_future(future)
                yield step.runner_output_to_pb(output, step_id, seconds)
        except Exception:
            if not self.stopping:
                raise
            # The server stops under an open stream (the end of a drain): not an error.
        finally:
            stream.ended = True  # steps queued behind the one running are skipped
            reader.cancel()
            log.info("scheduler %s disconnected; dropping %d requests", peer, len(self._live))
            # Taken now, before the next stream can add requests; run on the runner thread after
            # this stream's last step and before the next stream's first (one FIFO thread). Not
            # awaited: the generator may be closing because its task was cancelled.
            drop = self._take_live()
            self._stream_open = False
            asyncio.get_running_loop().create_task(drop)

    async def _read_steps(self, request_iterator, stream: _StepStream) -> None:
        """Hand each step to the runner thread as soon as it arrives. With asynchronous scheduling
        the next step arrives while one runs: queued behind it on the one FIFO thread, it starts the
        moment that one ends, not after the event loop has sent its answer and read the next
        message. ``stream.steps`` gets ``(step_id, future)`` per step, then None (the scheduler
        closed its side) or the error that ended the reading."""
        try:
            async for msg in request_iterator:
                scheduler_output = step.scheduler_output_from_pb(msg)
                self._track_live(scheduler_output)
                future = self._executor.submit(self._run_step, scheduler_output, stream)
                stream.steps.put_nowait((msg.step_id, future))
            stream.steps.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - the call's reading failed: the handler raises it
            stream.steps.put_nowait(exc)

    def _run_step(self, scheduler_output: SchedulerOutput, stream: _StepStream) -> tuple[ModelRunnerOutput, float]:
        """On the runner thread: one step, and its seconds. After a failed step, or once the stream
        ended, the steps queued behind it are not run (the scheduler treats the worker as lost)."""
        if stream.ended:
            raise StepSkippedError("an earlier step of this stream failed, or the stream ended")
        started = time.perf_counter()
        try:
            output = self._runner.execute_model(scheduler_output)
        except BaseException:
            stream.ended = True
            raise
        if self._step_delay_s and scheduler_output.total_num_scheduled_tokens:
            time.sleep(self._step_delay_s)
        self.num_steps += 1
        return output, time.perf_counter() - started

    async def Reset(self, request, context):
        # While a scheduler drives this worker its plan mirrors the runner's requests: dropping them
        # under it would fail its next step. Closing the Step stream drops them already.
        if self._stream_open:
            raise FailedPreconditionError("a scheduler drives this worker (a Step stream is open); "
                                          "Reset is only allowed when no Step stream is open")
        return worker_pb2.ResetResponse(num_dropped=await self._drop_all())

    # -- runner calls ---------------------------------------------------------------------------------

    def _track_live(self, scheduler_output: SchedulerOutput) -> None:
        live = self._live
        live.difference_update(scheduler_output.finished_req_ids)
        live.difference_update(scheduler_output.preempted_req_ids)
        live.update(r.request_id for r in scheduler_output.scheduled_new_reqs)
        if live:
            self._idle.clear()
        else:
            self._idle.set()

    async def _drop_all(self) -> int:
        """Finish every live request in the runner (one empty step carrying their ids)."""
        return await self._take_live()

    def _take_live(self):
        """Detach the live set now; the returned coroutine drops those requests in the runner."""
        dropped, self._live = self._live, set()
        future = None
        if dropped:
            try:
                future = asyncio.get_running_loop().run_in_executor(
                    self._executor, self._runner.execute_model, SchedulerOutput(finished_req_ids=dropped))
            except RuntimeError:  # the runner thread is shut down: nothing left to drop from
                future = None

        async def finish() -> int:
            if future is not None:
                await future
            self._idle.set()
            return len(dropped)

        return finish()

    async def wait_idle(self) -> None:
        """Returns once the runner holds no request (used while draining)."""
        await self._idle.wait()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def build_server(servicer: WorkerServicer, *, internal_token: str = "") -> ServerLifecycle:
    """With ``internal_token``, every call but health checks must carry it."""
    lifecycle = ServerLifecycle([WORKER_SERVICE], interceptors=internal_interceptors(internal_token))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, lifecycle.server)
    return lifecycle
