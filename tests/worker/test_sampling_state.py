"""Per-request sampling state is built once, when the worker takes the request:
a min_tokens request with a long stop list costs its steps a gather, not a rebuild and sort."""

from __future__ import annotations

import random

import pytest

from servicekit.contract.scheduling import SchedulingConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from servicekit.contract.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from worker.factories import TINY_EOS, TINY_VOCAB, make_hf_model, make_runner, random_prompts
from worker_service import input_batch


@pytest.fixture(scope="module")
def hf():
    return make_hf_model()


@pytest.fixture
def banned_id_builds(monkeypatch) -> list[str]:
    """Records each build of a request's min_tokens ban list (the real builder still runs)."""
    builds: list[str] = []
    real = input_batch.min_tokens_banned_ids

    def counting(params, eos_token_ids, vocab_size):
        builds.append(params.stop_token_ids)
        return real(params, eos_token_ids, vocab_size)

    monkeypatch.setattr(input_batch, "min_tokens_banned_ids", counting)
    return builds


def run_to_completion(scheduler: Scheduler, runner) -> tuple[int, dict[str, list[int]]]:
    """Drive scheduler + runner as the engine does; returns (steps, output tokens by request)."""
    outputs: dict[str, list[int]] = {}
    steps = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        for out in scheduler.update_from_output(plan, runner.execute_model(plan)):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    return steps, outputs


def test_min_tokens_ban_list_is_built_once_per_request_not_per_step(hf, banned_id_builds):
    runner = make_runner(hf)
    scheduler = Scheduler(SchedulingConfig(max_num_batched_tokens=64), runner.info, seed_rng=random.Random(0))
    # The most stop ids a request may carry: every id but a handful, so the ban list is long.
    stop_ids = tuple(range(3, 3 + MAX_STOP_TOKEN_IDS))
    min_tokens = 12
    prompt_a, prompt_b = random_prompts([9, 5], seed=3)
    scheduler.add_request(Request("a", prompt_a, SamplingParams(
        max_tokens=min_tokens + 2, min_tokens=min_tokens, stop_token_ids=stop_ids, temperature=1.0, seed=7)))
    scheduler.add_request(Request("b", prompt_b, SamplingParams(max_tokens=4, temperature=0.0)))

    steps, outputs = run_to_completion(scheduler, runner)

    print(f"{steps} steps, {len(banned_id_builds)} ban-list builds")
    assert steps > min_tokens  # the ban applied on many steps ...
    assert banned_id_builds == [stop_ids]  # ... and was built once, for the request that has min_tokens
    banned = set(stop_ids) | {TINY_EOS}
    assert not banned & set(outputs["a"][:min_tokens])  # and it still bans: no stop id, no EOS early
    assert len(outputs["a"]) >= min_tokens


def test_ban_list_holds_stop_ids_and_eos_in_the_vocabulary_sorted():
    params = SamplingParams(min_tokens=3, stop_token_ids=(40, 7, TINY_VOCAB + 5, 7))
    assert input_batch.min_tokens_banned_ids(params, (TINY_EOS,), TINY_VOCAB).tolist() == [TINY_EOS, 7, 40]
    ignoring_eos = SamplingParams(min_tokens=3, stop_token_ids=(40,), ignore_eos=True)
    assert input_batch.min_tokens_banned_ids(ignoring_eos, (TINY_EOS,), TINY_VOCAB).tolist() == [40]
