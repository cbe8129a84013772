"""Operator-side reads of a scheduler's admin surface (SchedulerAdmin.Stats), as dataclasses.

    stats = scheduler_stats("127.0.0.1:50052")
    for w in stats.workers:
        print(w.address, w.num_running, w.num_free_blocks, "/", w.num_total_blocks, w.prefix_cache_hit_rate)
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from pagedserve.errors import from_rpc_error
from servicekit.auth import bearer_metadata
from servicekit.proto.pb import scheduler_pb2, scheduler_pb2_grpc
from servicekit.tls import TlsFiles, aio_channel, sync_channel


@dataclass(frozen=True, slots=True)
class WorkerPoolStats:
    """One worker as its scheduler sees it (its block pool lives in the scheduler)."""

    address: str
    worker_id: str
    model: str
    connected: bool
    releasing: bool
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int  # free or only cached: all free when equal to num_total_blocks
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    num_routed: int
    num_routed_prefix_hit: int
    num_preemptions: int
    num_steps: int
    num_steps_ahead: int = 0  # of num_steps, sent while the step before ran (asynchronous scheduling)

    @property
    def all_free(self) -> bool:
        return self.num_free_blocks == self.num_total_blocks and not self.num_running and not self.num_waiting


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    consumer: str
    num_running: int
    num_waiting: int
    num_finished: int
    num_aborted: int
    num_resumed: int
    num_reclaimed: int
    num_dead_lettered: int
    num_taken_over: int
    workers: tuple[WorkerPoolStats, ...]


def _from_pb(msg: scheduler_pb2.StatsResponse) -> SchedulerStats:
    workers = tuple(WorkerPoolStats(
        address=w.address, worker_id=w.worker_id, model=w.model, connected=w.connected, releasing=w.releasing,
        num_running=w.num_running, num_waiting=w.num_waiting, num_total_blocks=w.num_total_blocks,
        num_free_blocks=w.num_free_blocks, kv_cache_usage=w.kv_cache_usage,
        prefix_cache_hit_rate=w.prefix_cache_hit_rate, prefix_cache_hit_tokens=w.prefix_cache_hit_tokens,
        prefix_cache_query_tokens=w.prefix_cache_query_tokens, num_routed=w.num_routed,
        num_routed_prefix_hit=w.num_routed_prefix_hit, num_preemptions=w.num_preemptions, num_steps=w.num_steps,
        num_steps_ahead=w.num_steps_ahead)
        for w in msg.workers)
    return SchedulerStats(
        consumer=msg.consumer, num_running=msg.num_running, num_waiting=msg.num_waiting,
        num_finished=msg.num_finished, num_aborted=msg.num_aborted, num_resumed=msg.num_resumed,
        num_reclaimed=msg.num_reclaimed, num_dead_lettered=msg.num_dead_lettered,
        num_taken_over=msg.num_taken_over, workers=workers)


def scheduler_stats(address: str, *, timeout: float = 5.0, token: str = "", tls: TlsFiles | None = None) -> SchedulerStats:
    """SchedulerAdmin.Stats of the scheduler at ``address`` (blocking); ``token``: the internal
    token, ``tls``: its TLS files, when the scheduler requires them."""
    with sync_channel(address, tls) as channel:
        try:
            reply = scheduler_pb2_grpc.SchedulerAdminStub(channel).Stats(
                scheduler_pb2.StatsRequest(), timeout=timeout, metadata=bearer_metadata(token))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
    return _from_pb(reply)


async def async_scheduler_stats(address: str, *, timeout: float = 5.0, token: str = "",
                                tls: TlsFiles | None = None) -> SchedulerStats:
    """SchedulerAdmin.Stats of the scheduler at ``address`` (asyncio)."""
    async with aio_channel(address, tls, []) as channel:
        try:
            reply = await scheduler_pb2_grpc.SchedulerAdminStub(channel).Stats(
                scheduler_pb2.StatsRequest(), timeout=timeout, metadata=bearer_metadata(token))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
    return _from_pb(reply)
