"""Scheduler-side protobuf <-> dataclass conversions: the Step stream (worker.proto, the inverse of
``worker_service/convert.py``), the Redis records (queue.proto) and the admin stats
(scheduler.proto). Nothing else in the scheduler service touches ``*_pb2`` (STYLE.md 5)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from scheduler_service.core.request import Request
from servicekit.contract.step import (
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)
from servicekit.contract.worker import WorkerDescription
from servicekit.proto.convert import (
    FINISH_REASON_TO_PB,
    logprobs_from_pb,
    logprobs_to_pb,
    sampling_params_from_pb,
    sampling_params_to_pb,
)
from servicekit.proto.pb import queue_pb2, scheduler_pb2, worker_pb2


def worker_description_from_pb(msg: worker_pb2.DescribeResponse) -> WorkerDescription:
    return WorkerDescription(
        model=msg.model, num_blocks=msg.num_blocks, block_size=msg.block_size, max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size, eos_token_ids=tuple(msg.eos_token_ids), max_num_seqs=msg.max_num_seqs,
        max_num_batched_tokens=msg.max_num_batched_tokens,
        prefill_chunk_attention_limit=msg.prefill_chunk_attention_limit, worker_id=msg.worker_id)


def scheduler_output_to_pb(so: SchedulerOutput, step_id: int) -> worker_pb2.StepRequest:
    msg = worker_pb2.StepRequest(
        step_id=step_id, total_num_scheduled_tokens=so.total_num_scheduled_tokens,
        finished_req_ids=so.finished_req_ids, preempted_req_ids=so.preempted_req_ids)
    n = so.num_scheduled_tokens
    for r in so.scheduled_new_reqs:
        new = msg.scheduled_new_reqs.add(
            request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, output_token_ids=r.output_token_ids,
            block_ids=r.block_ids, num_computed_tokens=r.num_computed_tokens,
            num_scheduled_tokens=n[r.request_id])
        sampling_params_to_pb(r.sampling_params, new.sampling_params)
    for r in so.scheduled_cached_reqs:
        msg.scheduled_cached_reqs.add(
            request_id=r.request_id, new_block_ids=r.new_block_ids, num_computed_tokens=r.num_computed_tokens,
            num_scheduled_tokens=n[r.request_id])
    return msg


def runner_output_from_pb(msg: worker_pb2.StepResponse) -> ModelRunnerOutput:
    sampled: dict[str, list[int]] = {}
    logprobs = {}
    for out in msg.outputs:
        sampled[out.request_id] = list(out.token_ids)
        if out.logprobs:
            logprobs[out.request_id] = logprobs_from_pb(out.logprobs)
    prompt = {p.request_id: (p.first_index, logprobs_from_pb(p.logprobs)) for p in msg.prompt_logprobs}
    return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt)


# -- Redis records ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """An EngineRequest as the scheduler reads it from the request stream."""

    request: Request  # ready for Scheduler.add_request
    deadline: float  # wall-clock seconds; 0 = none


def queued_request_from_record(data: bytes, output_token_ids=()) -> QueuedRequest:
    """The request of an EngineRequest record; ``output_token_ids``: outputs it already delivered
    (a request taken over from a dead scheduler resumes after them). Raises InvalidArgumentError
    (bad sampling params) or google.protobuf DecodeError."""
    msg = queue_pb2.EngineRequest.FromString(data)
    request = Request(
        msg.request_id, list(msg.prompt_token_ids), sampling_params_from_pb(msg.sampling_params, trusted=True),
        arrival_time=msg.arrival_time, priority=msg.priority, cache_salt=msg.cache_salt or None,
        output_token_ids=output_token_ids)
    return QueuedRequest(request, msg.deadline)


def delivered_outputs(records: list[bytes]) -> tuple[list[int], bool]:
    """The output tokens a request's output stream holds, by index (index i is the i-th token;
    repeats from a duplicated publish are skipped), and whether the stream already ended (a
    finish reason or an error record)."""
    tokens: list[int] = []
    for data in records:
        msg = queue_pb2.EngineOutput.FromString(data)
        if msg.error_message or msg.finish_reason != FINISH_REASON_TO_PB[None]:
            return tokens, True
        start = msg.first_index
        if start > len(tokens):
            break  # a gap cannot happen (records are published in order); stop at it to be safe
        tokens.extend(msg.token_ids[len(tokens) - start:])
    return tokens, False


def engine_output_to_record(out: EngineCoreOutput) -> bytes:
    msg = queue_pb2.EngineOutput(
        token_ids=out.new_token_ids, first_index=out.first_index,
        finish_reason=FINISH_REASON_TO_PB[out.finish_reason], num_cached_tokens=out.num_cached_tokens)
    if out.new_logprobs:
        logprobs_to_pb(out.new_logprobs, msg.logprobs)
    if out.prompt_logprobs:
        logprobs_to_pb(out.prompt_logprobs, msg.prompt_logprobs)
    return msg.SerializeToString()


def error_record(field: str, message: str, code: str | None = None) -> bytes:
    """The last record of a request the scheduler refused or lost (finish reason ABORT), with the
    status its client gets: ``code`` (a status name, as errors carry it), else INVALID_ARGUMENT when ``field`` is at fault, else
    ABORTED."""
    if code is None:
        code = "INVALID_ARGUMENT" if field else "ABORTED"
    return queue_pb2.EngineOutput(
        finish_reason=FINISH_REASON_TO_PB[FinishReason.ABORT],
        error_field=field, error_message=message, error_code=grpc.StatusCode[code].value[0]).SerializeToString()


# -- admin ---------------------------------------------------------------------------------------------


def stats_to_pb(stats, *, consumer: str) -> scheduler_pb2.StatsResponse:
    """``stats``: scheduler_service.service.ServiceStats."""
    msg = scheduler_pb2.StatsResponse(
        num_finished=stats.num_finished, num_aborted=stats.num_aborted, consumer=consumer,
        num_resumed=stats.num_resumed, num_reclaimed=stats.num_reclaimed,
        num_dead_lettered=stats.num_dead_lettered, num_taken_over=stats.num_taken_over)
    for w in stats.workers:
        core = w.core
        msg.workers.add(
            address=w.address, model=w.model, connected=w.connected, num_steps=w.num_steps,
            num_steps_ahead=w.num_steps_ahead,
            worker_id=w.worker_id, num_routed=w.num_routed, num_routed_prefix_hit=w.num_routed_prefix_hit,
            releasing=w.releasing,
            prefix_cache_hit_tokens=core.prefix_cache_hits if core else 0,
            prefix_cache_query_tokens=core.prefix_cache_queries if core else 0,
            num_running=core.num_running if core else 0, num_waiting=core.num_waiting if core else 0,
            num_total_blocks=core.num_total_blocks if core else 0,
            num_free_blocks=core.num_free_blocks if core else 0,
            kv_cache_usage=core.kv_cache_usage if core else 0.0,
            prefix_cache_hit_rate=core.prefix_cache_hit_rate if core else 0.0,
            num_preemptions=core.num_preemptions if core else 0)
    msg.num_running = sum(w.num_running for w in msg.workers)
    msg.num_waiting = sum(w.num_waiting for w in msg.workers)
    return msg
