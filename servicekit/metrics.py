"""Prometheus metrics every service shares: the gRPC server interceptor, vLLM's histogram bounds,
and the metrics port.

- :class:`GrpcMetricsInterceptor` counts and times every RPC in the naming of the Go and Java gRPC
  Prometheus libraries (``grpc_server_started_total``, ``grpc_server_handled_total{grpc_code}``,
  ``grpc_server_handling_seconds``), so their dashboards and alerts apply unchanged.
  py-grpc-prometheus is sync-only; this one is a ``grpc.aio`` interceptor.
- Every service keeps its metrics in its own :class:`CollectorRegistry` (``ServerLifecycle.registry``),
  never the process-global one: services that share a process (tests, ``pagedserve serve``) keep
  their numbers apart.
- :class:`MetricsPort` serves a registry's ``/metrics`` over HTTP on the service's event loop.

Names of our own metrics start with :data:`PREFIX`, as vLLM's start with ``vllm:``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, make_asgi_app

from servicekit.http_server import HttpServer

PREFIX = "pagedserve:"

# vLLM v1's bucket bounds (vllm/v1/metrics/loggers.py), so its dashboards port by renaming.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # e2e and queue time
# Redis calls are sub-millisecond on loopback, milliseconds across a network.
REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GRPC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _rpc_type(handler) -> str:
    if handler.unary_unary:
        return "UNARY"
    if handler.unary_stream:
        return "SERVER_STREAM"
    if handler.stream_unary:
        return "CLIENT_STREAM"
    return "BIDI_STREAM"


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts started and handled RPCs (by status code) and times them. Placed outermost, it sees
    the status the error-mapping interceptor chose; a client's cancel counts as CANCELLED."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self._started = Counter("grpc_server_started_total", "RPCs started on the server.", labels,
                                registry=registry)
        self._handled = Counter("grpc_server_handled_total", "RPCs completed on the server, by status code.",
                                [*labels, "grpc_code"], registry=registry)
        self._seconds = Histogram("grpc_server_handling_seconds", "Time from the start of an RPC to its end.",
                                  labels, buckets=GRPC_BUCKETS, registry=registry)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        labels = (_rpc_type(handler), service, method)
        kwargs = dict(request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._wrap(handler.unary_unary, labels), **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._wrap(handler.unary_stream, labels), **kwargs)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._wrap(handler.stream_unary, labels), **kwargs)
        return grpc.stream_stream_rpc_method_handler(self._wrap(handler.stream_stream, labels), **kwargs)

    def _wrap(self, behavior, labels):
        # A streaming handler is an async generator, or a coroutine that writes with context.write
        # (grpc.health.v1 Watch): wrap each as what it is.
        return self._stream(behavior, labels) if inspect.isasyncgenfunction(behavior) else self._unary(behavior, labels)

    @contextlib.contextmanager
    def _measured(self, labels: tuple[str, str, str], context) -> Iterator[None]:
        """Counts the RPC started, then handled with its status code, and times it."""
        self._started.labels(*labels).inc()
        start, exc = time.perf_counter(), None
        try:
            yield
        except BaseException as e:
            exc = e
            raise
        finally:
            status = context.code()  # set by context.abort / set_code; None when the handler just returned
            if isinstance(status, grpc.StatusCode):
                code = status.name
            elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                code = "CANCELLED"  # the client went away or its deadline passed
            else:
                code = "OK" if exc is None else "UNKNOWN"
            self._handled.labels(*labels, code).inc()
            self._seconds.labels(*labels).observe(time.perf_counter() - start)

    def _unary(self, behavior, labels):
        async def unary(request, context):
            with self._measured(labels, context):
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
        return unary

    def _stream(self, behavior, labels):
        async def stream(request, context):
            with self._measured(labels, context):
                async for response in behavior(request, context):
                    yield response
        return stream


class MetricsPort:
    """A registry's ``/metrics`` on ``host:port`` (port 0: any free one; < 0: not served)."""

    def __init__(self, registry: CollectorRegistry, *, name: str) -> None:
        self._server = HttpServer(make_asgi_app(registry), name=f"{name}-metrics")
        self.port = -1

    async def start(self, host: str, port: int) -> int:
        if port < 0:
            return -1
        self.port = self._server.bind(host, port)
        await self._server.start()
        return self.port

    async def stop(self) -> None:
        if self.port >= 0:
            await self._server.stop(0.5)
