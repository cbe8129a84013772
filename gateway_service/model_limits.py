"""What the gateway knows of the served model: read from the worker registry in Redis
(``{prefix}workers:*``, written by each worker with a heartbeat) and refreshed in the background.

Choice: the gateway learns the model's name and limits from the workers'
registry entries rather than from a flag, so they cannot disagree with what the workers run. Only
workers of the gateway's own ``--model`` count (its tokenizer must match theirs). No such worker:
Generate answers UNAVAILABLE.

Readiness (``/health``): the model's limits are known *and* a scheduler drives one of its
workers (holds its lease), so a request sent now is served, not only queued.
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
        self.num_driven = 0  # the model's workers a scheduler drives (holds the lease of), at the last refresh
        self._task: asyncio.Task | None = None

    async def refresh(self) -> ModelInfo | None:
        records = await list_workers(self._redis, self._keys)
        limits = limits_from_records(self.model, records)
        if limits is None and records:
            log.warning("no registered worker serves %r (registered: %s)", self.model,
                        ", ".join(sorted({r.model for r in records})))
        mine = [self._keys.lease(r.worker_id) for r in records if r.model == self.model]
        self.num_driven = await self._redis.exists(*mine) if mine else 0
        self.current = limits
        return limits

    async def not_ready(self) -> str | None:
        """Why a request sent now would not be served yet (None: it would), refreshed at once when
        the last refresh said not ready."""
        for attempt in range(2):
            if self.current is None:
                reason = f"no worker serving {self.model!r} is registered"
            elif not self.num_driven:
                reason = f"no scheduler drives a worker of {self.model!r} yet"
            else:
                return None
            if attempt == 0:
                try:
                    await self.refresh()
                except RedisError as exc:
                    return f"the worker registry is unreadable ({type(exc).__name__})"
        return reason

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
