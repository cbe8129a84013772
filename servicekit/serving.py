"""What every service's gRPC server shares: error mapping, health, reflection, draining, logging.

- :class:`ErrorMappingInterceptor` maps typed errors to status codes once (docs/architecture.md, decision 8),
  and request bytes that do not decode to INVALID_ARGUMENT.
- :class:`ServerLifecycle` owns a ``grpc.aio`` server with ``grpc.health.v1`` and reflection;
  :meth:`ServerLifecycle.drain` flips health to NOT_SERVING, lets in-flight work finish within the
  grace period, then stops the server.
- :func:`wait_for_signal` turns SIGTERM / SIGINT into an awaitable, and :func:`wait_for_parent_exit`
  the death of the launcher that started the service (``PAGEDSERVE_PARENT_PID``) into another.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from servicekit.contract.errors import InvalidArgumentError, PagedServeError
from servicekit.metrics import GrpcMetricsInterceptor
from servicekit.proto.channel import CHANNEL_OPTIONS
from servicekit.proto.status import status_of
from servicekit.tls import TlsFiles, server_credentials

log = logging.getLogger(__name__)

SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
]


class StartupError(Exception):
    """A service cannot start as configured (its message names the setting to fix): the service
    prints it and exits 1, without a traceback."""


def server_options(overrides: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """SERVER_OPTIONS with ``overrides`` replacing options of the same name (message size limits,
    ``grpc.max_concurrent_streams``)."""
    names = {name for name, _ in overrides}
    return [(n, v) for n, v in SERVER_OPTIONS if n not in names] + list(overrides)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (and the traceback, if any), for log
    collectors. Messages are the same text as in the plain format: no prompt or completion text at
    INFO or above, no keys or passwords at any level."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def status_for_exception(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str, tuple]:
    """The (code, details, trailing metadata) a handler's exception travels as: a typed error's
    own; anything else is logged (a bug) and INTERNAL."""
    if isinstance(exc, PagedServeError):
        return status_of(exc)
    log.error("unexpected error in %s", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}", ()


async def _abort_with(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code, details, trailing = status_for_exception(exc, method)
    if trailing:
        context.set_trailing_metadata(trailing)
    await context.abort(code, details)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions escaping a handler into status codes: typed errors keep their code (and
    an INVALID_ARGUMENT its field in trailing metadata); anything else is logged and INTERNAL.
    A unary request whose bytes do not decode (bad UTF-8 in a string, truncated, garbage) is
    INVALID_ARGUMENT (field "request"), logged at INFO: bad input, not a server fault."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return rewrap_handler(handler, _wrap, handler_call_details.method,
                              unary_deserializer=_tolerant(handler.request_deserializer))


def rewrap_handler(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable, str], Callable], method: str, *,
                   unary_deserializer: Callable | None = None) -> grpc.RpcMethodHandler:
    """``handler`` with its behavior replaced by ``wrap(behavior, method)`` (same kind: unary or
    streaming on either side); ``unary_deserializer`` replaces a unary request's deserializer."""
    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    unary_kwargs = dict(kwargs, request_deserializer=unary_deserializer or handler.request_deserializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, method), **unary_kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, method), **unary_kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, method), **kwargs)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, method), **kwargs)


class _Undecodable:
    """Stands in for a request whose bytes did not decode; the handler wrapper refuses it."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserializer: Callable | None) -> Callable | None:
    """``deserializer`` returning :class:`_Undecodable` instead of raising: grpc would answer a
    raising one UNKNOWN with the exception's text and log an ERROR traceback."""
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, or UnicodeDecodeError from some protobuf builds
            return _Undecodable(type(exc).__name__)
    return deserialize


def _check_decoded(request, method: str) -> None:
    if isinstance(request, _Undecodable):
        log.info("%s: undecodable request refused (%s)", method, request.reason)
        raise InvalidArgumentError("request", "the request bytes do not decode as the method's message "
                                              "(malformed protobuf or invalid UTF-8 in a string field)")


def _wrap(behavior: Callable, method: str) -> Callable:
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            try:
                _check_decoded(request, method)
                async for response in behavior(request, context):
                    yield response
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:
                await _abort_with(context, exc, method)
        return stream

    async def unary(request, context):
        try:
            _check_decoded(request, method)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _abort_with(context, exc, method)
    return unary


class ServerLifecycle:
    """A ``grpc.aio`` server with health checking and reflection for ``service_names``.

    Health: the overall status ("") and each named service are SERVING after :meth:`start` and
    NOT_SERVING from the moment :meth:`drain` begins; a service may also turn its named services'
    status with :meth:`set_serving` (readiness: the overall status stays liveness). ``registry``
    holds the service's Prometheus metrics, the gRPC server's among them.
    """

    def __init__(self, service_names: Iterable[str], *, interceptors: Iterable = (), reflection_on: bool = True,
                 options: Sequence[tuple[str, Any]] = (), registry: CollectorRegistry | None = None) -> None:
        self.service_names = list(service_names)
        # The service's metrics (servicekit.metrics): gRPC server metrics here, the service's own beside.
        self.registry = registry if registry is not None else CollectorRegistry()
        # Metrics outermost, so they count the status the error mapping chose.
        self.server = grpc.aio.server(
            interceptors=[GrpcMetricsInterceptor(self.registry), ErrorMappingInterceptor(), *interceptors],
            options=server_options(options))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflection_on:
            reflection.enable_server_reflection(
                [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port = 0
        self.draining = False

    def bind(self, address: str, tls: TlsFiles | None = None) -> int:
        """Listen on ``address`` (``host:port``; port 0 picks a free one), with TLS when ``tls``
        is enabled (client certificates required when it names a CA); returns the port."""
        if tls is not None and tls.enabled:
            port = self.server.add_secure_port(address, server_credentials(tls))
        else:
            port = self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        self.port = port
        return port

    async def start(self) -> None:
        await self.server.start()
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_serving(self, serving: bool) -> None:
        """The named services' status (not the overall one): SERVING or NOT_SERVING. Ignored once
        draining (all stay NOT_SERVING)."""
        if self.draining:
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.service_names:
            await self.health.set(name, status)

    async def drain(self, grace_s: float, wait_idle: Callable[[], Awaitable[None]] | None = None) -> None:
        """NOT_SERVING now; then wait for ``wait_idle`` (the service's own in-flight work) at most
        ``grace_s`` seconds; then stop the server, cancelling whatever is left."""
        self.draining = True
        await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        if wait_idle is not None:
            try:
                await asyncio.wait_for(wait_idle(), timeout=grace_s)
            except asyncio.TimeoutError:
                log.warning("drain grace of %.1fs passed with work still in flight", grace_s)
        await self.server.stop(max(0.0, deadline - loop.time()))


def cancel_requested() -> bool:
    """True once the current task was asked to cancel (Python 3.11+), even if a library turned the
    CancelledError into an ordinary error (grpc.aio reports a cancelled call as CANCELLED, a Redis
    client as a connection error): service loops check it so they end instead of retrying."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(task is not None and cancelling is not None and cancelling())


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout_s: float = 5.0) -> None:
    """Cancel ``tasks`` and wait for them, at most ``timeout_s``: one that swallowed its
    cancellation is logged and left behind instead of hanging a shutdown."""
    tasks = [t for t in tasks if t is not None]
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        log.warning("task %s did not stop within %.1fs of its cancellation", task.get_name(), timeout_s)


async def wait_for_signal(signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> int:
    """Return the number of the first of ``signals`` received (handlers are removed again)."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()
    signals = list(signals)
    for sig in signals:
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(s))
    try:
        return await received
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


# Set by a launcher (``pagedserve serve``) to its own pid in each service it starts: a service whose
# launcher is gone (killed with SIGKILL, so it could not stop its children) drains and exits, instead
# of serving on as an orphan that holds the stack's ports.
PARENT_PID_ENV = "PAGEDSERVE_PARENT_PID"
PARENT_POLL_S = 0.5


async def wait_for_parent_exit(parent_pid: int, poll_s: float = PARENT_POLL_S) -> None:
    """Return once this process's parent is no longer ``parent_pid``: the parent died and the process
    was handed to init (or a subreaper)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(poll_s)


def _parent_pid(env: Mapping[str, str], name: str) -> int | None:
    """The launcher's pid to watch, from ``PAGEDSERVE_PARENT_PID``; None when unset, unreadable, or
    not this process's parent (the variable leaked into a process someone else started)."""
    value = env.get(PARENT_PID_ENV, "")
    if not value:
        return None
    try:
        pid = int(value)
    except ValueError:
        log.warning("pagedserve %s: ignoring %s=%r (not a pid)", name, PARENT_PID_ENV, value)
        return None
    if pid != os.getppid():
        log.warning("pagedserve %s: ignoring %s=%d: the parent is %d", name, PARENT_PID_ENV, pid, os.getppid())
        return None
    return pid


class _App(Protocol):
    async def start(self) -> None: ...
    async def drain(self) -> None: ...


def service_main(name: str, build_parser: Callable[[Mapping[str, str]], argparse.ArgumentParser],
                 settings_from_args: Callable[[argparse.Namespace], Any], make_app: Callable[[Any], _App],
                 argv: Sequence[str] | None, env: Mapping[str, str] | None) -> int:
    """The ``main()`` every service shares: flags + ``PAGEDSERVE_*`` env → frozen settings (a bad
    value exits 2 with the message), then start the app, serve until SIGTERM/SIGINT and drain it
    within the settings' ``drain_grace_s``."""
    env = os.environ if env is None else env
    args = build_parser(env).parse_args(argv)
    configure_logging(args.log_level, getattr(args, "log_format", "text"))
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"pagedserve {name}: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve_until_signal(name, make_app(settings), settings.drain_grace_s, _parent_pid(env, name)))
    except StartupError as exc:
        print(f"pagedserve {name}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve_until_signal(name: str, app: _App, grace_s: float, parent_pid: int | None = None) -> None:
    """Serve until SIGTERM / SIGINT, or until the launcher ``parent_pid`` (if given) is gone; then drain."""
    service_log = logging.getLogger(f"pagedserve.{name}")
    await app.start()
    signalled = asyncio.ensure_future(wait_for_signal())
    waits = [signalled] if parent_pid is None else [signalled, asyncio.ensure_future(wait_for_parent_exit(parent_pid))]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    if signalled.done() and not signalled.cancelled():
        service_log.info("signal %d: draining (grace %.0fs)", signalled.result(), grace_s)
    else:
        service_log.warning("the launcher (pid %d) is gone: draining (grace %.0fs)", parent_pid, grace_s)
    await app.drain()
    service_log.info("%s stopped", name)
