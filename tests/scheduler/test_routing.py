"""KV-aware routing (``scheduler_service.routing``): a request goes to the worker that holds its
prefix, else to the least loaded one, and only to a worker whose KV cache can hold it."""

from __future__ import annotations

import dataclasses

import pytest

from servicekit.contract.scheduling import SchedulingConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.routing import choose_engine
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import ModelRunnerOutput
from servicekit.contract.worker import WorkerDescription

INFO = WorkerDescription(model="m", num_blocks=64, block_size=4, max_model_len=128, vocab_size=1000, eos_token_ids=(2,))
SHARED_PREFIX = list(range(100, 124))  # 6 full blocks of 4


class FakeEngine:
    def __init__(self, name: str, load: int = 0, max_num_seqs: int = 4, num_blocks: int = INFO.num_blocks) -> None:
        self.name = name
        info = dataclasses.replace(INFO, num_blocks=num_blocks)
        self.core = Scheduler(SchedulingConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256), info)
        self.load = load

    def fits(self, request: Request) -> bool:
        return self.core.fits(request)  # as WorkerEngine.fits

    def run_to_completion(self, request: Request) -> None:
        """Prefill + one sampled token: its full prompt blocks enter this engine's prefix cache."""
        self.core.add_request(request)
        so = self.core.schedule()
        self.core.update_from_output(so, ModelRunnerOutput(sampled_token_ids={request.request_id: [7]}))


def make_request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1, seed=1, ignore_eos=True))


def test_routing_prefers_the_worker_holding_the_prefix_even_when_busier():
    cold, warm = FakeEngine("cold", load=0), FakeEngine("warm", load=2)
    warm.run_to_completion(make_request("first", SHARED_PREFIX + [1]))
    engine, hit = choose_engine(make_request("repeat", SHARED_PREFIX + [9, 9]), [cold, warm])
    assert engine is warm and hit == len(SHARED_PREFIX)


def test_routing_without_a_hit_picks_the_least_loaded():
    busy, idle = FakeEngine("busy", load=3), FakeEngine("idle", load=1)
    engine, hit = choose_engine(make_request("new", [5, 6, 7, 8, 9]), [busy, idle])
    assert engine is idle and hit == 0


def test_a_hot_prefix_spills_over_once_its_worker_has_no_free_seat():
    cold, warm = FakeEngine("cold", load=0), FakeEngine("warm", load=0)
    warm.run_to_completion(make_request("first", SHARED_PREFIX + [1]))
    warm.load = warm.core.config.max_num_seqs  # every batch seat taken
    engine, _hit = choose_engine(make_request("repeat", SHARED_PREFIX + [3]), [cold, warm])
    assert engine is cold


def test_a_request_goes_only_to_a_worker_whose_kv_cache_can_hold_it():
    """Workers may differ in KV-cache size: the least loaded one here cannot hold prompt +
    max_tokens at all (its core would refuse the request), so it goes to the one that can."""
    small, large = FakeEngine("small", load=0, num_blocks=4), FakeEngine("large", load=3)
    request = Request("long", SHARED_PREFIX, SamplingParams(max_tokens=8, seed=1, ignore_eos=True))  # 8 blocks
    assert not small.core.fits(request) and large.core.fits(request)
    engine, _hit = choose_engine(request, [small, large])
    assert engine is large
    too_long = Request("too-long", SHARED_PREFIX, SamplingParams(max_tokens=INFO.max_model_len, seed=1))
    assert not large.core.fits(too_long)  # past max_model_len on every worker
    with pytest.raises(InvalidArgumentError, match="max_tokens: prompt \\+ max_tokens \\(32 tokens\\) needs more KV"):
        small.core.add_request(request)
