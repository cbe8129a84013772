"""The scheduler's wire conversions (``scheduler_service.convert``): the step diff round trip between
scheduler and worker, and decoding what a request already delivered from its output records."""

from __future__ import annotations

from scheduler_service import convert
from scheduler_service import convert as scheduler_convert
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from worker_service import convert as worker_convert


def test_step_diff_round_trips_between_scheduler_and_worker():
    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3], [4], SamplingParams(seed=5, max_tokens=9), [1, 2], 0)],
        scheduled_cached_reqs=[CachedRequestData("b", [7], 30)],
        num_scheduled_tokens={"a": 4, "b": 1}, total_num_scheduled_tokens=5,
        finished_req_ids={"c"}, preempted_req_ids={"d"})
    assert worker_convert.scheduler_output_from_pb(scheduler_convert.scheduler_output_to_pb(so, 1)) == so

    out = ModelRunnerOutput(sampled_token_ids={"a": [11], "b": [12]},
                            logprobs={"a": [TokenLogprobs(11, -0.5, [(11, -0.5), (3, -1.5)])]})
    back = scheduler_convert.runner_output_from_pb(worker_convert.runner_output_to_pb(1, out, 0.01))
    assert back.sampled_token_ids == out.sampled_token_ids
    assert back.logprobs["a"][0].token_id == 11 and back.logprobs["a"][0].top[1][0] == 3


def record(first_index: int, tokens: list[int], finish: FinishReason | None = None) -> bytes:
    return convert.engine_output_to_record(EngineCoreOutput("r", tokens, first_index, finish))


def test_delivered_outputs_are_read_by_index_and_repeats_are_skipped():
    admission_marker = b""
    records = [admission_marker, record(0, [5, 6]), record(2, [7]), record(1, [6, 7]), record(3, [8])]
    assert convert.delivered_outputs(records) == ([5, 6, 7, 8], False)
    assert convert.delivered_outputs([*records, record(4, [9], FinishReason.LENGTH)]) == ([5, 6, 7, 8], True)
