"""The SDK's errors (``pagedserve.errors``): a gRPC status becomes the typed error, with its field."""

from __future__ import annotations

import grpc

from pagedserve.errors import InvalidArgumentError, from_rpc_error


def test_invalid_argument_survives_the_wire_with_its_field():
    class FakeRpcError(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return "temperature: must be >= 0.0, got -1"

        def trailing_metadata(self):
            return (("pagedserve-field", "temperature"),)

    err = from_rpc_error(FakeRpcError())
    assert isinstance(err, InvalidArgumentError)
    assert err.field == "temperature" and err.message == "must be >= 0.0, got -1"
