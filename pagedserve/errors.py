"""The typed errors the SDK raises (``except pagedserve.errors.InvalidArgumentError as e: e.field``).

They are the services' own error classes (``servicekit.contract.errors``); a failed call becomes
one of them through :func:`from_rpc_error`, whose ``error.code`` is the ``grpc.StatusCode``.
"""

from __future__ import annotations

from servicekit.contract.errors import (
    AbortedError,
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PagedServeError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from servicekit.proto.status import FIELD_METADATA_KEY
from servicekit.proto.status import error_from_rpc as from_rpc_error

__all__ = [
    "FIELD_METADATA_KEY", "AbortedError", "AlreadyExistsError", "CancelledError", "DeadlineExceededError",
    "FailedPreconditionError", "InternalError", "InvalidArgumentError", "NotFoundError", "PagedServeError",
    "ResourceExhaustedError", "UnauthenticatedError", "UnavailableError", "from_rpc_error",
]
