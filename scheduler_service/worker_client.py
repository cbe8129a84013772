"""The scheduler's connection to one worker: Describe, the long-lived Step stream, Reset, and a
health watch (a worker that starts draining gets no new requests)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.auth import bearer_metadata
from servicekit.contract.step import ModelRunnerOutput, SchedulerOutput
from servicekit.contract.worker import WorkerDescription
from servicekit.proto import step
from servicekit.proto.channel import CHANNEL_OPTIONS
from servicekit.proto.pb import WORKER_SERVICE, worker_pb2, worker_pb2_grpc
from servicekit.tls import TlsFiles, aio_channel

log = logging.getLogger(__name__)


class WorkerLostError(RuntimeError):
    """The worker's Step stream broke or answered out of order; its requests' state there is gone."""


class WorkerClient:
    """Invariant: at most one Step call is open; one task at a time sends and receives; each sent
    step is answered by exactly one read, in the order sent (the worker runs them in order). Up to
    two steps may be in flight (asynchronous scheduling: the next one is sent before the answer
    to the one running)."""

    def __init__(self, address: str, *, tls: TlsFiles | None = None, token: str = "") -> None:
        self.address = address
        # TLS material is read here: a (re)connect picks up renewed certificates.
        self._channel = aio_channel(address, tls, CHANNEL_OPTIONS)
        self._metadata = bearer_metadata(token)  # on every call (health checks too: harmless)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._call = None
        self._step_id = 0
        self._in_flight: collections.deque[int] = collections.deque()  # step ids sent, not answered
        self._broken: str | None = None  # why break_stream() cancelled the call

    async def describe(self, timeout_s: float = 30.0) -> WorkerDescription:
        # Not wait_for_ready: a dead address (a registry entry not expired yet) fails at once
        # instead of holding a claim attempt for the whole timeout; the supervisor retries.
        msg = await self._stub.Describe(worker_pb2.DescribeRequest(), timeout=timeout_s, metadata=self._metadata)
        return step.worker_description_from_pb(msg)

    async def reset(self, timeout_s: float = 30.0) -> int:
        reply = await self._stub.Reset(worker_pb2.ResetRequest(), timeout=timeout_s, metadata=self._metadata)
        return reply.num_dropped

    async def open_stream(self) -> None:
        self._call = self._stub.Step(metadata=self._metadata)
        self._step_id = 0
        self._in_flight.clear()

    async def step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Send one step's diff and wait for its sampled tokens (nothing else in flight)."""
        await self.send(scheduler_output)
        return await self.receive()

    async def send(self, scheduler_output: SchedulerOutput) -> None:
        """Send one step's diff; its answer comes from :meth:`receive`, after those of the steps
        sent before it."""
        call = self._current_call()
        self._step_id += 1
        try:
            await call.write(step.scheduler_output_to_pb(scheduler_output, self._step_id))
        except grpc.aio.AioRpcError as exc:
            raise WorkerLostError(f"worker {self.address}: {exc.code().name}: {exc.details()}") from exc
        except asyncio.InvalidStateError:
            # The call ended before this write: a step in flight failed on the worker (its answer
            # never comes), or the worker went away. Not a scheduler bug: its requests resume elsewhere.
            code, details = await call.code(), await call.details()
            raise WorkerLostError(f"worker {self.address}: Step stream ended: {code.name}: {details}") from None
        except asyncio.CancelledError:
            self._raise_if_broken(call)
            raise
        self._in_flight.append(self._step_id)

    async def receive(self) -> ModelRunnerOutput:
        """The sampled tokens of the oldest step in flight."""
        call = self._current_call()
        if not self._in_flight:
            raise RuntimeError("receive() with no step in flight")
        try:
            reply = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise WorkerLostError(f"worker {self.address}: {exc.code().name}: {exc.details()}") from exc
        except asyncio.CancelledError:
            self._raise_if_broken(call)
            raise
        if reply is grpc.aio.EOF:
            raise WorkerLostError(f"worker {self.address}: Step stream ended")
        expected = self._in_flight.popleft()
        if reply.step_id != expected:
            raise WorkerLostError(f"worker {self.address}: answer for step {reply.step_id}, expected {expected}")
        try:
            return step.runner_output_from_pb(reply)
        except ValueError as exc:  # columns that do not add up: not ours to trust, nor a scheduler bug
            raise WorkerLostError(f"worker {self.address}: malformed answer to step {reply.step_id}: {exc}") from exc

    def _current_call(self):
        if self._call is None:
            raise WorkerLostError(f"worker {self.address}: {self._broken or 'no Step stream open'}")
        return self._call

    def _raise_if_broken(self, call) -> None:
        """A call cancelled under a pending read or write raises CancelledError in its task: ours
        (break_stream) means the worker is lost; anything else is this task's cancellation."""
        if self._broken is not None and call is not self._call:
            raise WorkerLostError(f"worker {self.address}: {self._broken}") from None

    def break_stream(self, reason: str = "stream broken by the scheduler") -> None:
        """Cancel the Step call: a step in flight (or the next one) raises WorkerLostError. Used
        when the worker is declared lost by other means (heartbeat expired and unreachable, lease
        lost, released to another scheduler)."""
        self._broken = reason
        if self._call is not None:
            call, self._call = self._call, None
            call.cancel()

    async def check_health(self, timeout_s: float) -> bool | None:
        """One health check of the Worker service: True SERVING, False NOT_SERVING (draining),
        None unreachable or no answer within ``timeout_s``."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError):
            return None
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def watch_health(self, on_change: Callable[[bool | None], None]) -> None:
        """Call ``on_change(serving)`` on every health change of the Worker service (False: it
        drains), and ``on_change(None)`` when the watch ends (the worker is gone)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        call = stub.Watch(health_pb2.HealthCheckRequest(service=WORKER_SERVICE))
        try:
            async for reply in call:
                on_change(reply.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.aio.AioRpcError as exc:
            log.debug("health watch of %s ended: %s", self.address, exc.code().name)
        on_change(None)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        await self._channel.close()


class LeaseRefusedError(RuntimeError):
    """Another scheduler holds the worker's lease."""


async def connect(address: str, *, timeout_s: float = 30.0,
                  claim: Callable[[WorkerDescription], Awaitable[bool]] | None = None,
                  tls: TlsFiles | None = None, token: str = "") -> tuple[WorkerClient, WorkerDescription]:
    """Dial, describe, ``claim`` the worker (take its lease; False: LeaseRefusedError) and open the
    Step stream; raises on failure (the client is closed then): WorkerLostError when the worker
    refuses the stream, grpc.aio.AioRpcError when unreachable."""
    client = WorkerClient(address, tls=tls, token=token)
    try:
        description = await client.describe(timeout_s)
        if claim is not None and not await claim(description):
            raise LeaseRefusedError(f"worker {address} ({description.worker_id}) is driven by another scheduler")
        await client.open_stream()
        # An empty step proves the stream is ours (a worker driven by another scheduler refuses).
        await client.step(SchedulerOutput())
    except BaseException:
        await client.close()
        raise
    return client, description

