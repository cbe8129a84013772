"""gRPC status codes <-> the typed errors of :mod:`servicekit.contract.errors`.

The field of an INVALID_ARGUMENT travels in the trailing metadata key ``pagedserve-field`` (and
starts the details text: ``"temperature: must be >= 0.0, got -1"``).
"""

from __future__ import annotations

import grpc

from servicekit.contract.errors import ERRORS_BY_CODE, InvalidArgumentError, PagedServeError

FIELD_METADATA_KEY = "pagedserve-field"


def status_of(error: PagedServeError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """``(code, details, trailing metadata)`` a typed error travels as."""
    if isinstance(error, InvalidArgumentError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error), ((FIELD_METADATA_KEY, error.field),)
    code = error.code if isinstance(error.code, grpc.StatusCode) else grpc.StatusCode[error.code]
    return code, error.message, ()


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
