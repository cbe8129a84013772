"""A client that stops reading its stream cannot grow the gateway's memory: its call's buffer of
output records is bounded (``max_buffered_outputs``); past it the request is aborted at once (as
for a client gone) and the call ends RESOURCE_EXHAUSTED when the client reads again.

The client shrinks its HTTP/2 receive window (1 KiB, no BDP probing) and asks for top-20 logprobs,
so its window fills after a few chunks and the gateway's writes to it stall, as they would for a
client whose socket buffers are full. Bound on the gateway's memory per such call: at most
``max_buffered_outputs`` output records (each one step's tokens of one request: tens to hundreds
of bytes; with logprobs up to ~1 KB) plus one HTTP/2 stream window of encoded chunks."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from pagedserve import wire
from servicekit.auth import bearer_metadata
from servicekit.tls import aio_channel

from .conftest import KEYS, MAX_BUFFERED_OUTPUTS

pytestmark = pytest.mark.asyncio(loop_scope="session")

SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
MAX_TOKENS = 480  # the tiny model's max_model_len is 512


def _rss_kib() -> int:
    """This process's resident set now (the in-process stack's gateway lives here)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _subscription(gateway, request_id: str):
    for sub in gateway.gateway._fanout._all_subs():
        if sub.key.endswith(request_id):
            return sub
    return None


async def test_a_client_that_stops_reading_is_cut_off_at_the_buffer_bound(secure_stack, pki):
    from servicekit.proto.pb import generation_pb2_grpc

    request_id = "slow-reader-1"
    request = wire.build_generate_request("Once upon a time", request_id=request_id, max_tokens=MAX_TOKENS,
                                          ignore_eos=True, logprobs=20)
    aborted_before = secure_stack.scheduler.stats().num_aborted
    rss_before_kib = _rss_kib()
    async with aio_channel(secure_stack.gateway_address, pki.client, SMALL_WINDOW) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(
            request, timeout=55, metadata=bearer_metadata(KEYS["alice"]))
        most_pending = 0
        sub = None
        for _ in range(400):  # read nothing, up to 40 s, while the request generates
            sub = _subscription(secure_stack, request_id) or sub
            if sub is not None:
                most_pending = max(most_pending, sub.pending)
                if sub.overflowed:
                    break
            await asyncio.sleep(0.1)
        assert sub is not None and sub.overflowed, "the gateway kept buffering for a client that reads nothing"
        assert most_pending <= MAX_BUFFERED_OUTPUTS
        for _ in range(100):  # the request is aborted without waiting for the client
            if secure_stack.scheduler.stats().num_aborted > aborted_before:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the slow reader's request was not aborted")
        tokens = 0
        with pytest.raises(grpc.aio.AioRpcError) as err:  # reading again: what was buffered, then the error
            async for chunk in call:
                tokens += len(chunk.token_ids)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max-buffered-outputs" in err.value.details()
        assert tokens < MAX_TOKENS
    print(f"slow reader: {tokens} tokens delivered of {MAX_TOKENS}; at most {most_pending} records buffered "
          f"(bound {MAX_BUFFERED_OUTPUTS}); test process RSS {rss_before_kib} -> {_rss_kib()} KiB "
          "(whole process: stack, model and client)")
