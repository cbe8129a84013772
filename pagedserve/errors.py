"""Typed errors, shared by the services (which raise them) and the SDK (which receives them).

A service raises one of these; ``pagedserve.serving.ErrorMappingInterceptor`` turns it into its
status code in one place (DESIGN.md decision 8). The SDK turns a status code back into the same
class with :func:`from_rpc_error`, so ``except pagedserve.errors.InvalidArgumentError as e: e.field``
works across the wire. The field of an INVALID_ARGUMENT travels in the trailing metadata key
``pagedserve-field`` (and starts the details text: ``"temperature: must be >= 0.0, got -1"``).
"""

from __future__ import annotations

import grpc

FIELD_METADATA_KEY = "pagedserve-field"


class PagedServeError(Exception):
    """Base class; ``code`` is the gRPC status code the error travels as."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message


class InvalidArgumentError(PagedServeError):
    """A request field is out of range or malformed; ``field`` names it."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class ResourceExhaustedError(PagedServeError):
    """The request queue is full: retry later, with backoff."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(PagedServeError):
    """The service is draining, starting, or has no worker: retry elsewhere or later."""

    code = grpc.StatusCode.UNAVAILABLE


class NotFoundError(PagedServeError):
    """The named thing (a request to resume) is not known, or no longer kept."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(PagedServeError):
    """A client-chosen request id is already in use."""

    code = grpc.StatusCode.ALREADY_EXISTS


class AbortedError(PagedServeError):
    """The service gave the request up (its scheduler failed it, or it was taken over from dead
    schedulers more often than the retry limit allows). Retrying it unchanged is unlikely to help."""

    code = grpc.StatusCode.ABORTED


class FailedPreconditionError(PagedServeError):
    """The call does not fit the server's state (e.g. a worker already driven by a scheduler)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DeadlineExceededError(PagedServeError):
    """The call's deadline passed; the request was aborted."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(PagedServeError):
    """The call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class UnauthenticatedError(PagedServeError):
    """Missing or bad credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


class InternalError(PagedServeError):
    """A bug or an unexpected failure on the server."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[PagedServeError]] = {
    cls.code: cls
    for cls in (ResourceExhaustedError, UnavailableError, NotFoundError, AlreadyExistsError, AbortedError,
                FailedPreconditionError, DeadlineExceededError, CancelledError, UnauthenticatedError,
                InternalError)
}


def error_for_code(code: grpc.StatusCode, message: str, *, field: str = "") -> PagedServeError:
    """The typed error that travels as ``code`` (an INVALID_ARGUMENT names ``field``)."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgumentError(field, message)
    error = _BY_CODE.get(code, PagedServeError)(message)
    error.code = code
    return error


def from_rpc_error(err: grpc.RpcError) -> PagedServeError:
    """The typed error for a failed call (``grpc.RpcError`` / ``grpc.aio.AioRpcError``)."""
    code = err.code()
    details = err.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = ""
        for key, value in err.trailing_metadata() or ():
            if key == FIELD_METADATA_KEY:
                field = value
        if not field and ": " in details:
            field = details.split(": ", 1)[0]
        message = details.split(": ", 1)[1] if details.startswith(f"{field}: ") else details
        return InvalidArgumentError(field, message)
    return error_for_code(code, details)
