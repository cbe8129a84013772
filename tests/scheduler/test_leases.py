"""Worker leases (``scheduler_service.leases``): one scheduler holds a worker until it releases the
lease or stops renewing it."""

from __future__ import annotations

import asyncio

from scheduler_service.leases import WorkerLeases
from servicekit.redis_layout import RedisKeys


async def test_a_lease_has_one_holder_until_released_or_expired(redis):
    keys = RedisKeys("lease-test:")
    a = WorkerLeases(redis, keys, "sched-a", ttl_s=0.3)
    b = WorkerLeases(redis, keys, "sched-b", ttl_s=0.3)
    assert await a.acquire("w1") and not await b.acquire("w1")
    assert await a.renew(["w1"]) == {"w1": True}
    await b.release("w1")  # not b's: nothing happens
    assert await a.holder("w1") == "sched-a"
    await a.release("w1")
    assert await b.acquire("w1")
    await asyncio.sleep(0.4)  # b stops renewing: the lease expires
    assert await a.acquire("w1")
    assert await b.renew(["w1"]) == {"w1": False}  # b learns it lost the worker
