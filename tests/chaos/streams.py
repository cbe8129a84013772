"""What every chaos test does around its fault: run greedy streams through the gateways, break
something once every stream is mid-generation, then check that each stream completed with each
output index exactly once and the tokens of a run without faults; and ask the schedulers what they
hold and drive."""

from __future__ import annotations

import asyncio
import dataclasses

from pagedserve.admin import async_scheduler_stats
from pagedserve.aio_client import AsyncClient
from pagedserve.local_cluster import LocalCluster

from .conftest import wait_for_async

TOKENS_BEFORE_FAULT = 8


@dataclasses.dataclass
class StreamLog:
    indices: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list = dataclasses.field(default_factory=list)  # every one received (asked for: once)

    def add(self, chunk) -> None:
        self.indices.extend(range(chunk.first_index, chunk.first_index + len(chunk.token_ids)))
        self.tokens.extend(chunk.token_ids)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        self.finish_reason = chunk.finish_reason or self.finish_reason


async def streams_with_a_fault(gateways: list[str], prompts: list[str], max_tokens: int, fault, *,
                               finish_within_s: float = 120, tokens_before_fault: int = TOKENS_BEFORE_FAULT,
                               per_stream: list[dict] | None = None, client_options: dict | None = None,
                               **sampling) -> list[StreamLog]:
    """Run one greedy stream per prompt (with ``sampling`` arguments besides, and ``per_stream[i]``
    for stream i) through one SDK client (``client_options``: its API key, TLS files); once every
    one has ``tokens_before_fault`` tokens and none has finished, ``await fault()`` (0: as the
    streams open, before any token); then wait up to ``finish_within_s`` for all of them (failing
    with how many are still open)."""
    logs = [StreamLog() for _ in prompts]
    async with AsyncClient(gateways, timeout=finish_within_s + 120, **(client_options or {})) as client:
        async def one(i: int) -> None:
            kwargs = {"temperature": 0, "ignore_eos": True, **sampling, **(per_stream[i] if per_stream else {})}
            async with client.stream(prompts[i], max_tokens=max_tokens, **kwargs) as stream:
                async for chunk in stream:
                    logs[i].add(chunk)

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        try:
            async def all_started() -> bool:
                for task in tasks:
                    if task.done():
                        task.result()  # a stream that failed early fails the test with its error
                return all(len(log.tokens) >= tokens_before_fault for log in logs)

            if tokens_before_fault:
                await wait_for_async(all_started, 60, f"every stream has {tokens_before_fault} tokens")
            else:
                await asyncio.sleep(0)  # the calls start; no token can have arrived
            assert not any(log.finish_reason for log in logs), "a stream finished before the fault"
            await fault()
            done, pending = await asyncio.wait(tasks, timeout=finish_within_s)
            for task in done:
                task.result()  # a stream that failed fails the test with its error
            assert not pending, (f"{len(pending)} of {len(tasks)} streams still open {finish_within_s:.0f}s after "
                                 f"the fault (tokens so far: {sorted(len(log.tokens) for log in logs)})")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return logs


def assert_exactly_the_fault_free_outputs(logs: list[StreamLog], expected: list[list[int]], max_tokens: int) -> None:
    for i, (log, want) in enumerate(zip(logs, expected, strict=True)):
        assert log.indices == list(range(max_tokens)), f"stream {i}: indices missing or repeated"
        assert log.tokens == want, f"stream {i}: tokens differ from the run without faults"
        assert log.finish_reason == "length"


async def held_requests(stack: LocalCluster) -> dict[str, int]:
    """Worker address -> requests its scheduler holds on it (running + waiting)."""
    held: dict[str, int] = {}
    for scheduler in stack.live("scheduler"):
        for w in (await async_scheduler_stats(scheduler.address, tls=stack.tls)).workers:
            held[w.address] = w.num_running + w.num_waiting
    return held


async def busiest_worker(stack: LocalCluster):
    """The live worker whose scheduler holds the most requests on it (it holds some)."""
    held = await held_requests(stack)
    victim = max(stack.live("worker"), key=lambda w: held.get(w.address, 0))
    assert held.get(victim.address, 0) > 0
    return victim


async def driven_workers(stack: LocalCluster) -> dict[str, list[str]]:
    """Scheduler name -> addresses of the workers it drives (connected, not being handed over)."""
    driven = {}
    for scheduler in stack.live("scheduler"):
        stats = await async_scheduler_stats(scheduler.address, tls=stack.tls)
        driven[scheduler.name] = sorted(w.address for w in stats.workers if w.connected and not w.releasing)
    return driven


async def assert_surviving_pools_all_free(stack: LocalCluster) -> None:
    """Every live worker is driven by a live scheduler, and each one's block pool is all free."""
    live_workers = {w.address for w in stack.live("worker")}

    async def settled() -> bool:
        seen = {}
        for scheduler in stack.live("scheduler"):
            for w in (await async_scheduler_stats(scheduler.address, tls=stack.tls)).workers:
                if w.connected:
                    seen[w.address] = w
        return set(seen) == live_workers and all(w.all_free for w in seen.values())

    await wait_for_async(settled, 30, "every surviving worker is driven and its block pool is all free", 0.2)
