"""The SDK's failover decisions (``pagedserve.failover``): which failed call is tried again, on which
gateway, from which output index, and within the stream's deadline."""

from __future__ import annotations

import time

import grpc
import pytest

from pagedserve.failover import Failover, parse_addresses
from servicekit.proto.pb import generation_pb2


def test_failover_resumes_from_the_next_index_on_the_next_gateway():
    request = generation_pb2.GenerateRequest(request_id="r")
    failover = Failover(request, 2, retries=2, timeout=None)
    failover.on_chunk(0, 3)
    failover.on_chunk(3, 2)
    assert failover.next_try(grpc.StatusCode.UNAVAILABLE, "Socket closed") is not None
    assert request.resume_from_index == 5 and failover.address_index == 1
    assert failover.next_try(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2") is not None
    assert failover.address_index == 0
    assert failover.next_try(grpc.StatusCode.UNAVAILABLE, "") is None  # retries without progress spent
    assert failover.next_try(grpc.StatusCode.ABORTED, "request failed") is None


def test_a_call_the_grpc_core_failed_under_a_killed_gateway_is_resumed_elsewhere():
    """grpc.aio's status when the C core fails an operation of a call (the SDK writing a GenerateMany
    request into the connection of a gateway just killed): every stream of the call got it and
    raised InternalError (seen with random faults: a gateway and a worker killed as streams start)."""
    request = generation_pb2.GenerateRequest(request_id="r")
    failover = Failover(request, 2, retries=2, timeout=None)
    assert failover.next_try(grpc.StatusCode.INTERNAL, "Internal error from Core") is not None
    assert failover.address_index == 1
    assert failover.next_try(grpc.StatusCode.INTERNAL, "internal error: RuntimeError") is None  # the gateway's own


def test_failover_before_any_token_retries_the_request_then_follows_it():
    request = generation_pb2.GenerateRequest(request_id="r")
    failover = Failover(request, 1, retries=3, timeout=None)
    assert failover.next_try(grpc.StatusCode.UNAVAILABLE, "") is not None
    assert not request.HasField("resume_from_index")  # sent again as is (same id)
    assert failover.next_try(grpc.StatusCode.ALREADY_EXISTS, "in use") == 0.0  # the first try got through
    assert request.resume_from_index == 0


def test_failover_respects_the_streams_deadline():
    failover = Failover(generation_pb2.GenerateRequest(request_id="r"), 2, retries=5, timeout=0.1)
    time.sleep(0.1)
    assert failover.next_try(grpc.StatusCode.UNAVAILABLE, "") is None


def test_gateway_addresses_parse_from_a_list_or_a_comma_string():
    assert parse_addresses("a:1, b:2") == ["a:1", "b:2"] == parse_addresses(["a:1", "b:2"])
    with pytest.raises(ValueError):
        parse_addresses("")
