"""What the gateway knows of the served model: read from the worker registry in Redis
(``{prefix}workers:*``, written by each worker with a heartbeat) and refreshed in the background.

Choice: the gateway learns the model's name and limits from the workers'
registry entries rather than from a flag, so they cannot disagree with what the workers run. Only
workers of the gateway's own ``--model`` count (its tokenizer must match theirs). No such worker:
Generate answers UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from servicekit.contract.api import ModelInfo
from servicekit.contract.worker import WorkerDescription
from servicekit.redis_layout import RedisKeys
from servicekit.registry import list_workers
from servicekit.serving import cancel_and_wait, cancel_requested

log = logging.getLogger(__name__)


def limits_from_records(model: str, records: list[WorkerDescription]) -> ModelInfo | None:
    mine = [r for r in records if r.model == model]
    if not mine:
        return None
    return ModelInfo(
        model=model, max_model_len=min(r.max_model_len for r in mine), vocab_size=mine[0].vocab_size,
        block_size=mine[0].block_size, eos_token_ids=mine[0].eos_token_ids, num_workers=len(mine))


class ModelLimitsView:
    def __init__(self, redis, keys: RedisKeys, model: str, *, refresh_s: float = 2.0) -> None:
        self._redis = redis
        self._keys = keys
        self.model = model
        self._refresh_s = refresh_s
        self.current: ModelInfo | None = None
        self._task: asyncio.Task | None = None

    async def refresh(self) -> ModelInfo | None:
        records = await list_workers(self._redis, self._keys)
        limits = limits_from_records(self.model, records)
        if limits is None and records:
            log.warning("no registered worker serves %r (registered: %s)", self.model,
                        ", ".join(sorted({r.model for r in records})))
        self.current = limits
        return limits

    async def get(self) -> ModelInfo | None:
        """The limits, refreshing at once when none are known (a worker may have just registered)."""
        if self.current is None:
            try:
                await self.refresh()
            except RedisError as exc:
                log.warning("worker registry unreadable: %s", exc)
        return self.current

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="model-limits")

    async def _run(self) -> None:
        while not cancel_requested():
            try:
                await self.refresh()
            except RedisError as exc:
                log.warning("worker registry unreadable: %s", exc)
            await asyncio.sleep(self._refresh_s)

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
