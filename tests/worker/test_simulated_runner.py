"""The simulated runner (``worker_service.simulated_runner``): its tokens depend on the seed and the
position only, so a request resumed elsewhere continues with the same tokens."""

from __future__ import annotations

import pytest

from servicekit.contract.scheduling import SchedulingConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import EngineCoreOutput, SchedulerOutput
from servicekit.contract.worker import WorkerDescription
from worker_service.simulated_runner import SimulatedRunner, parse_step_latency, simulated_token

INFO = WorkerDescription(model="m", num_blocks=64, block_size=4, max_model_len=128, vocab_size=1000, eos_token_ids=(2,))


def step(runner: SimulatedRunner, core: Scheduler) -> list[EngineCoreOutput]:
    so: SchedulerOutput = core.schedule()
    return core.update_from_output(so, runner.execute_model(so))


def test_simulated_runner_tokens_depend_on_seed_and_position_only():
    """A request resumed elsewhere from its delivered outputs continues with the same tokens."""
    slept: list[float] = []
    params = SamplingParams(max_tokens=6, seed=42, ignore_eos=True)

    def generate(output_token_ids=()) -> list[int]:
        runner = SimulatedRunner(INFO, step_latency=(0.01, 0.001), sleep=slept.append)
        core = Scheduler(SchedulingConfig(max_num_seqs=4, max_num_batched_tokens=64), INFO)
        core.add_request(Request("r", [10, 11, 12], params, output_token_ids=output_token_ids))
        tokens = list(output_token_ids)
        while core.has_unfinished_requests():
            for out in step(runner, core):
                tokens.extend(out.new_token_ids)
        return tokens

    whole = generate()
    assert len(whole) == 6 and generate(whole[:3]) == whole
    assert slept[0] == pytest.approx(0.01 + 0.001 * 3)  # a + b x the first step's 3 prompt tokens
    assert parse_step_latency("0.02,0.0001") == (0.02, 0.0001)
    with pytest.raises(ValueError):
        parse_step_latency("0.02")


def test_simulated_runner_verifies_drafts_as_the_real_one():
    """The tokens up to the first that differs from its draft, then the one sampled there."""
    params = SamplingParams(max_tokens=12, seed=7, ignore_eos=True)
    runner = SimulatedRunner(INFO, step_latency=(0.0, 0.0), sleep=lambda s: None)
    core = Scheduler(SchedulingConfig(), INFO)
    core.add_request(Request("s", [1, 2, 3], params))
    step(runner, core)  # prefill: samples output 0
    right = [simulated_token(7, i, INFO.vocab_size, frozenset(INFO.eos_token_ids)) for i in range(1, 4)]
    so = core.schedule()
    so.num_scheduled_tokens["s"] = 3
    so.scheduled_spec_decode_tokens = {"s": [right[0], 0]}
    assert runner.execute_model(so).sampled_token_ids["s"] == right[:2]  # the first kept, the second corrected
