"""Worker-side protobuf <-> dataclass conversions (worker.proto). The scheduler's
``scheduler_service/convert.py`` holds the inverse of each; a round-trip test keeps them paired."""

from __future__ import annotations

from servicekit.contract.step import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from servicekit.contract.worker import WorkerDescription
from servicekit.proto.convert import logprobs_to_pb, sampling_params_from_pb
from servicekit.proto.pb import worker_pb2


def describe_to_pb(worker: WorkerDescription) -> worker_pb2.DescribeResponse:
    return worker_pb2.DescribeResponse(
        model=worker.model, num_blocks=worker.num_blocks, block_size=worker.block_size,
        max_model_len=worker.max_model_len, vocab_size=worker.vocab_size,
        eos_token_ids=list(worker.eos_token_ids), worker_id=worker.worker_id,
        max_num_seqs=worker.max_num_seqs, max_num_batched_tokens=worker.max_num_batched_tokens,
        prefill_chunk_attention_limit=worker.prefill_chunk_attention_limit)


def scheduler_output_from_pb(msg: worker_pb2.StepRequest) -> SchedulerOutput:
    """The step's diff as the model runner takes it."""
    num_scheduled: dict[str, int] = {}
    new_reqs = []
    for r in msg.scheduled_new_reqs:
        new_reqs.append(NewRequestData(
            request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids),
            output_token_ids=list(r.output_token_ids),
            sampling_params=sampling_params_from_pb(r.sampling_params, trusted=True),
            block_ids=list(r.block_ids), num_computed_tokens=r.num_computed_tokens))
        num_scheduled[r.request_id] = r.num_scheduled_tokens
    cached_reqs = []
    for r in msg.scheduled_cached_reqs:
        cached_reqs.append(CachedRequestData(
            request_id=r.request_id, new_block_ids=list(r.new_block_ids),
            num_computed_tokens=r.num_computed_tokens))
        num_scheduled[r.request_id] = r.num_scheduled_tokens
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
        num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_ids=set(msg.finished_req_ids), preempted_req_ids=set(msg.preempted_req_ids))


def runner_output_to_pb(step_id: int, output: ModelRunnerOutput, execute_seconds: float
                        ) -> worker_pb2.StepResponse:
    msg = worker_pb2.StepResponse(step_id=step_id, execute_seconds=execute_seconds)
    logprobs = output.logprobs
    for rid, token_ids in output.sampled_token_ids.items():
        sampled = msg.outputs.add(request_id=rid, token_ids=token_ids)
        if logprobs and rid in logprobs:
            logprobs_to_pb(logprobs[rid], sampled.logprobs)
    for rid, (first_index, items) in output.prompt_logprobs.items():
        logprobs_to_pb(items, msg.prompt_logprobs.add(request_id=rid, first_index=first_index).logprobs)
    return msg
