"""What the gateway knows of the served model: read from the worker registry in Redis
(``{prefix}workers:*``, written by each worker with a heartbeat) and refreshed in the background.

Choice: the gateway learns the model's name and limits from the workers'
registry entries rather than from a flag, so they cannot disagree with what the workers run. Only
workers of the gateway's own ``--model`` count (its tokenizer must match theirs).

Scale from zero: the limits seen are kept in Redis (``{prefix}model-limits:{model}``), so while no
worker is registered a gateway still knows them — from that record, else from the model's own
config and tokenizer (``fallback``) — with ``num_workers`` 0; whether it then admits (requests
wait in the queue for a worker) is the generation service's ``--worker-wait-s``.

Readiness (``/health``): the model's limits are known *and* a scheduler drives one of its
workers (holds its lease), so a request sent now is served, not only queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from servicekit.contract.api import ModelInfo
from servicekit.contract.worker import WorkerDescription
from servicekit.redis_layout import MODEL_LIMITS_TTL_S, RedisKeys
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


def limits_to_json(info: ModelInfo) -> str:
    return json.dumps({"max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
                       "block_size": info.block_size, "eos_token_ids": list(info.eos_token_ids)})


def limits_from_json(model: str, text: bytes | str) -> ModelInfo | None:
    try:
        d = json.loads(text)
        return ModelInfo(model=model, max_model_len=int(d["max_model_len"]), vocab_size=int(d["vocab_size"]),
                         block_size=int(d["block_size"]), eos_token_ids=tuple(int(t) for t in d["eos_token_ids"]),
                         num_workers=0)
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring a malformed model-limits record for %r", model)
        return None


class ModelLimitsView:
    """``current``: the limits (``num_workers`` 0: none registered now, the last seen or the
    ``fallback``'s), None when nothing is known."""

    def __init__(self, redis, keys: RedisKeys, model: str, *, refresh_s: float = 2.0,
                 fallback: Callable[[], ModelInfo | None] | None = None) -> None:
        self._redis = redis
        self._keys = keys
        self.model = model
        self.refresh_s = refresh_s
        self._fallback = fallback
        self._stored: ModelInfo | None = None  # what this view last wrote to (or read from) Redis
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
        if limits is not None:
            kept = dataclasses.replace(limits, num_workers=0)
            if kept != self._stored:  # written when they change, and re-armed for the month each start
                await self._redis.set(self._keys.model_limits(self.model), limits_to_json(limits), ex=MODEL_LIMITS_TTL_S)
                self._stored = kept
        else:
            limits = await self._absent_limits()
        self.current = limits
        return limits

    async def _absent_limits(self) -> ModelInfo | None:
        """No worker registered: the last limits seen in Redis, else the fallback's."""
        raw = await self._redis.get(self._keys.model_limits(self.model))
        limits = limits_from_json(self.model, raw) if raw is not None else None
        if limits is None and self._fallback is not None:
            limits = self._fallback()
        return limits

    @property
    def num_workers(self) -> int:
        return self.current.num_workers if self.current is not None else 0

    async def not_ready(self) -> str | None:
        """Why a request sent now would not be served yet (None: it would), refreshed at once when
        the last refresh said not ready."""
        for attempt in range(2):
            if not self.num_workers:
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
        """The limits, refreshing at once when no worker was registered (one may have just come)."""
        if not self.num_workers:
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
            await asyncio.sleep(self.refresh_s)

    async def stop(self) -> None:
        await cancel_and_wait([self._task])


def config_limits(model: str, hf_tokenizer, block_size: int = 16) -> ModelInfo | None:
    """The limits the model's own config and tokenizer give, before any worker of it ever
    registered (``max_position_embeddings``, the config's vocabulary and EOS ids, the workers'
    default block size); None when its config cannot be read here."""
    from transformers import AutoConfig

    from servicekit.gguf_cache import hf_folder
    from servicekit.model_registry import resolve_model

    try:
        source = hf_folder(resolve_model(model), weights=False)
        config = AutoConfig.from_pretrained(source.path, **source.from_pretrained_kwargs())
    except (OSError, ValueError) as exc:
        log.warning("no limits for %r from its config (%s): requests wait for a worker only once one registered",
                    model, exc)
        return None
    config = getattr(config, "text_config", None) or config
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = hf_tokenizer.eos_token_id
    eos_ids = tuple(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]) if t is not None)
    return ModelInfo(model=model, max_model_len=int(config.max_position_embeddings),
                     vocab_size=int(config.vocab_size), block_size=block_size, eos_token_ids=eos_ids, num_workers=0)
