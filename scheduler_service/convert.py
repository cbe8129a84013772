"""The scheduler's own protobuf conversions: its admin stats (scheduler.proto). The Step stream
and the Redis records are the ground's (``servicekit.proto.step``, ``servicekit.proto.queue``)."""

from __future__ import annotations

from servicekit.proto.pb import scheduler_pb2


def stats_to_pb(stats, *, consumer: str) -> scheduler_pb2.StatsResponse:
    """``stats``: scheduler_service.service.ServiceStats."""
    msg = scheduler_pb2.StatsResponse(
        num_finished=stats.num_finished, num_aborted=stats.num_aborted, consumer=consumer,
        num_resumed=stats.num_resumed, num_reclaimed=stats.num_reclaimed,
        num_dead_lettered=stats.num_dead_lettered, num_taken_over=stats.num_taken_over)
    for w in stats.workers:
        core = w.core
        msg.workers.add(
            address=w.address, model=w.model, connected=w.connected, num_steps=w.num_steps,
            num_steps_ahead=w.num_steps_ahead,
            worker_id=w.worker_id, num_routed=w.num_routed, num_routed_prefix_hit=w.num_routed_prefix_hit,
            releasing=w.releasing,
            prefix_cache_hit_tokens=core.prefix_cache_hits if core else 0,
            prefix_cache_query_tokens=core.prefix_cache_queries if core else 0,
            num_running=core.num_running if core else 0, num_waiting=core.num_waiting if core else 0,
            num_total_blocks=core.num_total_blocks if core else 0,
            num_free_blocks=core.num_free_blocks if core else 0,
            kv_cache_usage=core.kv_cache_usage if core else 0.0,
            prefix_cache_hit_rate=core.prefix_cache_hit_rate if core else 0.0,
            num_preemptions=core.num_preemptions if core else 0)
    msg.num_running = sum(w.num_running for w in msg.workers)
    msg.num_waiting = sum(w.num_waiting for w in msg.workers)
    return msg
