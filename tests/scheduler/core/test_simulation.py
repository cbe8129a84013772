"""End-to-end simulation: many requests, random arrivals, a pool small enough to force preemption.

A FakeWorker applies each step's diff and checks what a worker relies on; the model is a pure
function of (request, output index), so recomputation after preemption must reproduce every token.
"""

from __future__ import annotations

import random
import zlib

import pytest

from scheduler_service.core import FinishReason

from .helpers import EOS, FakeWorker, make_request, make_scheduler

SHARED_PREFIXES = [[11 + i for i in range(n)] for n in (0, 8, 13, 24)]  # system prompts, reused


def token_fn(request_id: str, index: int) -> int:
    """The fake model: deterministic per (request, position); EOS now and then (ignored: ignore_eos)."""
    return zlib.crc32(f"{request_id}/{index}".encode()) % 50 or EOS


def simulate(num_requests: int, seed: int, *, tenants: int = 0, model=token_fn, steps: list | None = None,
             num_drafts: int = 0, **config):
    """Run ``num_requests`` to the end and check every token; ``model(request_id, index)`` is the fake
    model, ``num_drafts`` the draft tokens its worker proposes, ``steps`` (when given) collects each
    step's plan."""
    rng = random.Random(seed)
    s = make_scheduler(seed_rng=random.Random(seed), **config)
    worker = FakeWorker(s.worker.num_blocks, s.worker.block_size, model, num_drafts=num_drafts)
    arrivals: dict[int, list] = {}
    expected: dict[str, int] = {}
    for k in range(num_requests):
        prompt = rng.choice(SHARED_PREFIXES) + [rng.randrange(10, 60) for _ in range(rng.randint(1, 40))]
        max_tokens = rng.randint(1, 32)
        request = make_request(request_id=f"sim-{seed}-{k}", prompt_token_ids=prompt, max_tokens=max_tokens,
                               ignore_eos=True, priority=rng.randrange(3), arrival_time=float(k))
        if tenants:
            request.tenant = f"t{rng.randrange(tenants)}"
            request.tenant_weight = 1.0 + int(request.tenant[1:])
        arrivals.setdefault(rng.randrange(num_requests // 2), []).append(request)
        expected[request.request_id] = max_tokens
    delivered: dict[str, list[int]] = {}
    finished: set[str] = set()
    step_no = 0
    while len(finished) < num_requests:
        for request in arrivals.pop(step_no, []):
            s.add_request(request)
        out = s.schedule()
        if steps is not None:
            steps.append(out)
        assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert s.num_running <= s.config.max_num_seqs
        for rid in out.num_scheduled_tokens:
            assert rid not in finished
        results = s.update_from_output(out, worker.execute(out))
        for o in results:
            got = delivered.setdefault(o.request_id, [])
            assert o.first_index == len(got), "an output index was skipped or repeated"
            got.extend(o.new_token_ids)
            if o.finished:
                assert o.finish_reason == FinishReason.LENGTH
                finished.add(o.request_id)
        step_no += 1
        assert step_no < 50 * num_requests, "no progress"
    for rid, n in expected.items():
        assert delivered[rid] == [model(rid, i) for i in range(n)]
    kv = s.kv_cache_manager
    assert not s.has_unfinished_requests() and s.num_waiting == 0 and s.num_running == 0
    assert kv.get_num_free_blocks() == kv.num_total_blocks and kv.usage == 0.0
    assert kv.req_to_blocks == {}
    kv.block_pool.check_invariants()
    return s.stats()


@pytest.mark.parametrize("config", [
    dict(),
    dict(policy="priority", long_prefill_token_threshold=16),
    dict(policy="fair", tenants=4),
    dict(policy="lpm"),
    dict(policy="spf"),
])
def test_thousand_requests_all_finish_exactly_under_preemption(config):
    stats = simulate(1000, seed=7, num_blocks=81, block_size=4, max_model_len=128, max_num_batched_tokens=64,
                     max_num_seqs=24, **config)
    assert stats.num_preemptions > 0  # the pool (320 tokens) forced preemption
    assert stats.prefix_cache_hits > 0  # shared system prompts were served from the cache


def test_simulation_without_chunking_or_caching():
    stats = simulate(300, seed=3, num_blocks=41, block_size=4, max_model_len=128, max_num_batched_tokens=128,
                     max_num_seqs=16, enable_chunked_prefill=False, enable_prefix_caching=False)
    assert stats.num_preemptions > 0 and stats.prefix_cache_queries == 0
