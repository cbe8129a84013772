"""The gRPC side of :mod:`servicekit.auth`: one server interceptor that admits a call only with a
key of its :class:`~servicekit.auth.KeyStore` in the ``authorization`` metadata, and the metadata a
client sends.

Health checking stays open (load balancers and container healthchecks carry no key), and so does
reflection unless the service closes it. The check runs inside the handler's own task, so
:func:`caller_key_digest` gives the handler the digest of the key that admitted the call (the
gateway stores it with the request: only that key may resume it). A refused call raises
UnauthenticatedError, which the shared ErrorMappingInterceptor turns into UNAUTHENTICATED.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from contextvars import ContextVar

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from servicekit.auth import AUTHORIZATION, KeyStore
from servicekit.serving import rewrap_handler

HEALTH_SERVICES = (health.SERVICE_NAME,)
REFLECTION_SERVICES = (reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection")

_caller_digest: ContextVar[str] = ContextVar("caller_key_digest", default="")
_caller_check: ContextVar[Callable[[], str]] = ContextVar("caller_key_check", default=lambda: "")


def caller_key_digest() -> str:
    """The digest of the key that admitted the current call ("" when the service has no keys)."""
    return _caller_digest.get()


def caller_key_check() -> Callable[[], str]:
    """For a long-lived call that starts work long after it was admitted (GenerateMany): a function
    that checks the call's key again — the key file may have changed since — returning its digest or
    raising UnauthenticatedError."""
    return _caller_check.get()


def _service_of(method: str) -> str:
    """``/pkg.Service/Method`` -> ``pkg.Service``."""
    return method.lstrip("/").partition("/")[0]


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION:
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def internal_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    """What an internal server (worker, scheduler admin) installs: ``token`` required on every
    call but health checks (none without a token)."""
    return [BearerAuthInterceptor(KeyStore.for_secret(token), open_services=HEALTH_SERVICES)] if token else []


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Every method outside ``open_services`` needs a key of ``store`` (a store without keys
    admits everything). Install after ErrorMappingInterceptor (ServerLifecycle does)."""

    def __init__(self, store: KeyStore, *, open_services: Iterable[str] = HEALTH_SERVICES + REFLECTION_SERVICES) -> None:
        self.store = store
        self._open = frozenset(open_services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or _service_of(handler_call_details.method) in self._open:
            return handler
        return rewrap_handler(handler, self._guard, handler_call_details.method)

    def _admit(self, context) -> None:
        authorization = _authorization(context)
        _caller_digest.set(self.store.check(authorization))
        _caller_check.set(lambda: self.store.check(authorization))

    def _guard(self, behavior: Callable, method: str) -> Callable:
        if inspect.isasyncgenfunction(behavior):
            async def stream(request, context):
                self._admit(context)
                async for response in behavior(request, context):
                    yield response
            return stream

        async def unary(request, context):
            self._admit(context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        return unary
