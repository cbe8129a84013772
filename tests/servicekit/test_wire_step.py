"""The Step stream's conversions (``servicekit.proto.step``), the one module both the scheduler and
the worker use: each to/from pair gives back what it was given, with a non-default value in every
field, dataclass -> protobuf -> dataclass and protobuf -> dataclass -> protobuf."""

from __future__ import annotations

import pytest

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
        scheduled_cached_reqs=CachedRequestData(["b", "e"], [[7], []], [30, 8]),
        num_scheduled_tokens={"a": 4, "b": 1, "e": 2}, total_num_scheduled_tokens=7,
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


def test_a_continuation_round_trips_with_its_draft_allowance():
    so = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["b", "e"], [[7], []], [30, 8]),
                         num_scheduled_tokens={"b": 1, "e": 1}, total_num_scheduled_tokens=2, finished_req_ids={"c"},
                         continuation=True, num_own_drafts=3)
    msg = step.scheduler_output_to_pb(so, 7)
    assert msg.continuation and msg.num_own_drafts == 3
    assert step.scheduler_output_from_pb(msg) == so
    plain = step.scheduler_output_from_pb(step.scheduler_output_to_pb(make_step(), 1))
    assert not plain.continuation and plain.num_own_drafts == 0


def test_runner_output_round_trips_between_worker_and_scheduler():
    out = make_runner_output()
    msg = step.runner_output_to_pb(out, 7, 0.25)
    assert (msg.step_id, msg.execute_seconds) == (7, 0.25)
    assert step.runner_output_from_pb(msg) == out
    assert step.runner_output_to_pb(step.runner_output_from_pb(msg), 7, 0.25) == msg


def test_a_decoding_step_goes_as_columns_without_per_request_counts():
    """The common step: every held request decodes one token, few get a block. The counts columns
    are left out when they say nothing (no block, one token each) and come back as such."""
    ids = [f"r{k}" for k in range(5)]
    so = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(ids, [[]] * 5, [10, 11, 12, 13, 14]),
                         num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=5)
    msg = step.scheduler_output_to_pb(so, 1)
    assert not msg.scheduled_cached_reqs.num_new_block_ids and not msg.scheduled_cached_reqs.new_block_ids
    assert step.scheduler_output_from_pb(msg) == so
    out = ModelRunnerOutput(sampled_token_ids={rid: [100 + k] for k, rid in enumerate(ids)})
    answer = step.runner_output_to_pb(out, 1, 0.0)
    assert not answer.sampled.num_token_ids and list(answer.sampled.token_ids) == [100, 101, 102, 103, 104]
    assert step.runner_output_from_pb(answer) == out


def test_columns_that_do_not_add_up_are_refused():
    answer = step.runner_output_to_pb(ModelRunnerOutput(sampled_token_ids={"a": [1], "b": [2]}), 1, 0.0)
    answer.sampled.token_ids.append(3)  # three tokens for two requests, no counts
    with pytest.raises(ValueError, match="2 requests and 3 tokens"):
        step.runner_output_from_pb(answer)
    answer.sampled.num_token_ids.extend([1, 1])  # counts that sum to 2 of 3
    with pytest.raises(ValueError, match="token counts"):
        step.runner_output_from_pb(answer)
    msg = step.scheduler_output_to_pb(make_step(), 1)
    msg.scheduled_cached_reqs.num_new_block_ids.append(4)  # a count for a request that is not there
    with pytest.raises(ValueError, match="block id counts"):
        step.scheduler_output_from_pb(msg)


def test_draft_tokens_go_as_columns_and_come_back():
    so = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["a", "b", "c"], [[], [4], []], [10, 20, 30]),
                         num_scheduled_tokens={"a": 4, "b": 1, "c": 3}, total_num_scheduled_tokens=8,
                         scheduled_spec_decode_tokens={"a": [5, 6, 7], "c": [8, 9]})
    msg = step.scheduler_output_to_pb(so, 3)
    assert list(msg.scheduled_spec_decode_tokens.num_token_ids) == [3, 2]
    assert step.scheduler_output_from_pb(msg) == so
    assert not step.scheduler_output_to_pb(make_step(), 1).HasField("scheduled_spec_decode_tokens")
    msg.scheduled_spec_decode_tokens.token_ids.append(1)  # a draft no count covers
    with pytest.raises(ValueError, match="draft token counts"):
        step.scheduler_output_from_pb(msg)


def test_draft_columns_that_name_a_request_twice_or_give_none_are_refused():
    so = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["a"], [[]], [10]), num_scheduled_tokens={"a": 3},
                         total_num_scheduled_tokens=3, scheduled_spec_decode_tokens={"a": [5, 6]})
    twice = step.scheduler_output_to_pb(so, 1)
    twice.scheduled_spec_decode_tokens.request_ids.append("a")
    twice.scheduled_spec_decode_tokens.num_token_ids.append(1)
    twice.scheduled_spec_decode_tokens.token_ids.append(7)
    none = step.scheduler_output_to_pb(so, 1)
    none.scheduled_spec_decode_tokens.request_ids.append("b")
    none.scheduled_spec_decode_tokens.num_token_ids.append(0)
    for msg in (twice, none):
        with pytest.raises(ValueError, match="twice or give one none"):
            step.scheduler_output_from_pb(msg)
