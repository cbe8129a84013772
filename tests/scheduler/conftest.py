"""Scheduler-service fixtures: an asyncio Redis client on the suite's redis-server."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis


@pytest.fixture
async def redis(redis_server):
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()
