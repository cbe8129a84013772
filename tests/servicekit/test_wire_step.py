"""The Step stream's conversions (``servicekit.proto.step``), the one module both the scheduler and
the worker use: each to/from pair gives back what it was given, with a non-default value in every
field, dataclass -> protobuf -> dataclass and protobuf -> dataclass -> protobuf."""

from __future__ import annotations

from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from servicekit.contract.worker import WorkerDescription
from servicekit.proto import step


def make_worker() -> WorkerDescription:
    return WorkerDescription(model="m", num_blocks=50, block_size=16, max_model_len=2048, vocab_size=512,
                             eos_token_ids=(2, 7), max_num_seqs=8, max_num_batched_tokens=1024,
                             prefill_chunk_attention_limit=1 << 20, worker_id="w-1")


def make_step() -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3], [4], SamplingParams(seed=5, max_tokens=9, top_k=3),
                                           [1, 2], 16)],
        scheduled_cached_reqs=[CachedRequestData("b", [7], 30)],
        num_scheduled_tokens={"a": 4, "b": 1}, total_num_scheduled_tokens=5,
        finished_req_ids={"c"}, preempted_req_ids={"d"})


def make_runner_output() -> ModelRunnerOutput:
    return ModelRunnerOutput(
        sampled_token_ids={"a": [11], "b": [12, 13]},
        logprobs={"a": [TokenLogprobs(11, -0.5, [(11, -0.5), (3, -1.5)], 1)]},
        prompt_logprobs={"a": (1, [TokenLogprobs(2, -0.25, [(2, -0.25)], 1), TokenLogprobs(3, -2.0, [], 4)])})


def test_the_worker_description_round_trips():
    worker = make_worker()
    assert step.worker_description_from_pb(step.worker_description_to_pb(worker)) == worker
    msg = step.worker_description_to_pb(worker)
    assert step.worker_description_to_pb(step.worker_description_from_pb(msg)) == msg


def test_step_diff_round_trips_between_scheduler_and_worker():
    so = make_step()
    msg = step.scheduler_output_to_pb(so, 7)
    assert msg.step_id == 7
    assert step.scheduler_output_from_pb(msg) == so
    assert step.scheduler_output_to_pb(step.scheduler_output_from_pb(msg), 7) == msg


def test_runner_output_round_trips_between_worker_and_scheduler():
    out = make_runner_output()
    msg = step.runner_output_to_pb(out, 7, 0.25)
    assert (msg.step_id, msg.execute_seconds) == (7, 0.25)
    assert step.runner_output_from_pb(msg) == out
    assert step.runner_output_to_pb(step.runner_output_from_pb(msg), 7, 0.25) == msg
