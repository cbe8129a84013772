"""gRPC status codes <-> the typed errors of :mod:`servicekit.contract.errors`.

The field of an INVALID_ARGUMENT travels in the trailing metadata key ``pagedserve-field`` (and
starts the details text: ``"temperature: must be >= 0.0, got -1"``).
"""

from __future__ import annotations

import grpc

from servicekit.contract.errors import ERRORS_BY_CODE, InvalidArgumentError, PagedServeError

FIELD_METADATA_KEY = "pagedserve-field"


# Details travel in a header whose size clients cap (16 KiB by default): a message that echoes a
# client's input (an unknown 20 kB model name) must not turn a clear error into a broken stream.
MAX_DETAILS_CHARS = 1024


def _bounded(text: str, limit: int = MAX_DETAILS_CHARS) -> str:
    return text if len(text) <= limit else text[:limit - 15] + "... (truncated)"


def status_of(error: PagedServeError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """``(code, details, trailing metadata)`` a typed error travels as (details at most
    MAX_DETAILS_CHARS characters)."""
    if isinstance(error, InvalidArgumentError):
        return (grpc.StatusCode.INVALID_ARGUMENT, _bounded(str(error)),
                ((FIELD_METADATA_KEY, _bounded(error.field, 128)),))
    code = error.code if isinstance(error.code, grpc.StatusCode) else grpc.StatusCode[error.code]
    return code, _bounded(error.message), ()


def error_from_rpc(err: grpc.RpcError) -> PagedServeError:
    """The typed error for a failed call (``grpc.RpcError`` / ``grpc.aio.AioRpcError``); its ``code``
    is the ``grpc.StatusCode`` the call failed with."""
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
        error: PagedServeError = InvalidArgumentError(field, message)
    else:
        error = ERRORS_BY_CODE.get(code.name, PagedServeError)(details)
    error.code = code  # on the client side: the grpc.StatusCode itself
    return error
