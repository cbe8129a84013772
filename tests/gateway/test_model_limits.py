"""What a gateway knows of its model (``gateway_service.model_limits``): the registered workers'
limits, kept in Redis so that with none registered (scale from zero) it still knows the last ones
seen, else its fallback's (the model's config)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from gateway_service.model_limits import ModelLimitsView, config_limits
from servicekit.contract.api import ModelInfo
from servicekit.contract.worker import WorkerDescription
from servicekit.redis_layout import RedisKeys
from servicekit.registry import worker_to_hash

pytestmark = [pytest.mark.service]


def _worker(worker_id: str, max_model_len: int) -> WorkerDescription:
    return WorkerDescription(worker_id=worker_id, address="127.0.0.1:1", model="m", num_blocks=64, block_size=16,
                             max_model_len=max_model_len, vocab_size=500, eos_token_ids=(2,))


@pytest.mark.asyncio
async def test_the_last_limits_seen_outlive_the_workers(redis_server):
    redis = aioredis.from_url(redis_server.url)
    keys = RedisKeys("limits-kept:")
    fallback = ModelInfo(model="m", max_model_len=9, vocab_size=9, eos_token_ids=(9,), num_workers=0, block_size=9)
    view = ModelLimitsView(redis, keys, "m", fallback=lambda: fallback)
    try:
        assert (await view.refresh()) == fallback  # never any worker: the fallback's
        for worker in (_worker("a", 1024), _worker("b", 512)):
            await redis.hset(keys.worker(worker.worker_id), mapping=worker_to_hash(worker))
        seen = await view.refresh()
        assert (seen.max_model_len, seen.num_workers) == (512, 2)
        assert 0 < await redis.ttl(keys.model_limits("m"))
        await redis.delete(keys.worker("a"), keys.worker("b"))
        # another gateway, started while no worker is registered, reads what this one kept
        other = ModelLimitsView(redis, keys, "m", fallback=lambda: fallback)
        for limits in (await view.refresh(), await other.refresh()):
            assert limits == ModelInfo(model="m", max_model_len=512, vocab_size=500, eos_token_ids=(2,),
                                       num_workers=0, block_size=16)
        assert not view.num_workers and await view.not_ready() == "no worker serving 'm' is registered"
    finally:
        await redis.aclose()


def test_config_limits_come_from_the_model_s_config_and_tokenizer(tiny_model_dir, hf_tokenizer):
    limits = config_limits(tiny_model_dir, hf_tokenizer)
    assert limits.max_model_len == 512 and limits.vocab_size == len(hf_tokenizer)
    assert limits.eos_token_ids == (hf_tokenizer.eos_token_id,) and limits.num_workers == 0
    assert config_limits("/no/such/model", hf_tokenizer) is None
