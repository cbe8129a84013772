"""Typed errors, shared by every service (which raise them) and the SDK (which receives them).

Standard library only, so the scheduler core raises them too. Each class names the gRPC status code
it travels as; ``servicekit.serving.ErrorMappingInterceptor`` turns a raised error into that status
in one place (docs/architecture.md, decision 8), and ``servicekit.proto.status.error_from_rpc`` turns a status
back into the same class, so ``except pagedserve.errors.InvalidArgumentError as e: e.field`` works
across the wire.
"""

from __future__ import annotations


class PagedServeError(Exception):
    """Base class; ``code`` names the gRPC status code the error travels as (``grpc.StatusCode[code]``)."""

    code: str = "UNKNOWN"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message


class InvalidArgumentError(PagedServeError, ValueError):
    """A request field (or setting) is out of range or malformed; ``field`` names it, by its public
    name (``temperature``, ``messages[1].role``, ``kv_cache_memory``). The one field-error type."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class ResourceExhaustedError(PagedServeError):
    """The request queue is full: retry later, with backoff."""

    code = "RESOURCE_EXHAUSTED"


class UnavailableError(PagedServeError):
    """The service is draining, starting, or has no worker: retry elsewhere or later."""

    code = "UNAVAILABLE"


class NotFoundError(PagedServeError):
    """The named thing (a request to resume) is not known, or no longer kept."""

    code = "NOT_FOUND"


class AlreadyExistsError(PagedServeError):
    """A client-chosen request id is already in use."""

    code = "ALREADY_EXISTS"


class AbortedError(PagedServeError):
    """The service gave the request up (its scheduler failed it, or it was taken over from dead
    schedulers more often than the retry limit allows). Retrying it unchanged is unlikely to help."""

    code = "ABORTED"


class FailedPreconditionError(PagedServeError):
    """The call does not fit the server's state (e.g. a worker already driven by a scheduler)."""

    code = "FAILED_PRECONDITION"


class DeadlineExceededError(PagedServeError):
    """The call's deadline passed; the request was aborted."""

    code = "DEADLINE_EXCEEDED"


class CancelledError(PagedServeError):
    """The call was cancelled."""

    code = "CANCELLED"


class UnauthenticatedError(PagedServeError):
    """Missing or bad credentials."""

    code = "UNAUTHENTICATED"


class InternalError(PagedServeError):
    """A bug or an unexpected failure on the server."""

    code = "INTERNAL"


ERRORS_BY_CODE: dict[str, type[PagedServeError]] = {
    cls.code: cls
    for cls in (InvalidArgumentError, ResourceExhaustedError, UnavailableError, NotFoundError, AlreadyExistsError,
                AbortedError, FailedPreconditionError, DeadlineExceededError, CancelledError, UnauthenticatedError,
                InternalError)
}


def error_for_code(code: str, message: str, *, field: str = "") -> PagedServeError:
    """The typed error that travels as status ``code`` (its name; an INVALID_ARGUMENT names ``field``)."""
    if code == InvalidArgumentError.code:
        return InvalidArgumentError(field, message)
    error = ERRORS_BY_CODE.get(code, PagedServeError)(message)
    error.code = code
    return error
