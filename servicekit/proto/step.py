"""The Step stream between a scheduler and a worker (worker.proto), as to/from pairs: the worker's
description (Describe), the step's diff (StepRequest, ``SchedulerOutput``) and what the step
produced (StepResponse, ``ModelRunnerOutput``). The scheduler writes what the worker reads and the
other way round, so both services use this one module; a round-trip test keeps each pair inverse.

The envelope fields (``step_id``, ``execute_seconds``) are set here and read by the caller from the
message: they belong to the stream, not to the dataclasses.
"""

from __future__ import annotations

from itertools import chain

from servicekit.contract.step import (
    NO_BLOCK_IDS,
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from servicekit.contract.worker import WorkerDescription
from servicekit.proto.pb import worker_pb2
from servicekit.proto.sampling import logprobs_from_pb, logprobs_to_pb, sampling_params_from_pb, sampling_params_to_pb


def _runs(flat, counts, num_requests: int, what: str, empty: list[int] | None = None) -> list[list[int]]:
    """``flat`` cut into consecutive runs of ``counts[i]`` values, one per request (``empty``, when
    given, for a run of none); ValueError naming ``what`` when the counts do not fit the requests
    and the values."""
    if len(counts) != num_requests or sum(counts) != len(flat):
        raise ValueError(f"a step's {what} counts do not match its requests and {what}s")
    runs, start = [], 0
    for count in counts:
        runs.append(empty if not count and empty is not None else list(flat[start:start + count]))
        start += count
    return runs


def worker_description_to_pb(worker: WorkerDescription) -> worker_pb2.DescribeResponse:
    """The worker's Describe answer (its ``address`` is not on the wire: the caller dialled it)."""
    return worker_pb2.DescribeResponse(
        model=worker.model, num_blocks=worker.num_blocks, block_size=worker.block_size,
        max_model_len=worker.max_model_len, vocab_size=worker.vocab_size,
        eos_token_ids=list(worker.eos_token_ids), worker_id=worker.worker_id,
        max_num_seqs=worker.max_num_seqs, max_num_batched_tokens=worker.max_num_batched_tokens,
        prefill_chunk_attention_limit=worker.prefill_chunk_attention_limit)


def worker_description_from_pb(msg: worker_pb2.DescribeResponse) -> WorkerDescription:
    return WorkerDescription(
        model=msg.model, num_blocks=msg.num_blocks, block_size=msg.block_size, max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size, eos_token_ids=tuple(msg.eos_token_ids), max_num_seqs=msg.max_num_seqs,
        max_num_batched_tokens=msg.max_num_batched_tokens,
        prefill_chunk_attention_limit=msg.prefill_chunk_attention_limit, worker_id=msg.worker_id)


def scheduler_output_to_pb(so: SchedulerOutput, step_id: int) -> worker_pb2.StepRequest:
    """The step's diff as the scheduler sends it; each request carries its ``num_scheduled_tokens``.
    The held requests go as packed columns: a decoding batch costs a few list copies, not a
    message per request."""
    msg = worker_pb2.StepRequest(
        step_id=step_id, total_num_scheduled_tokens=so.total_num_scheduled_tokens,
        finished_req_ids=so.finished_req_ids, preempted_req_ids=so.preempted_req_ids,
        continuation=so.continuation, num_own_drafts=so.num_own_drafts)
    n = so.num_scheduled_tokens
    for r in so.scheduled_new_reqs:
        new = msg.scheduled_new_reqs.add(
            request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, output_token_ids=r.output_token_ids,
            block_ids=r.block_ids, num_computed_tokens=r.num_computed_tokens,
            num_scheduled_tokens=n[r.request_id])
        sampling_params_to_pb(r.sampling_params, new.sampling_params)
    cached = so.scheduled_cached_reqs
    if cached.req_ids:
        out = msg.scheduled_cached_reqs
        out.request_ids.extend(cached.req_ids)
        out.num_computed_tokens.extend(cached.num_computed_tokens)
        out.num_scheduled_tokens.extend(map(n.__getitem__, cached.req_ids))
        counts = list(map(len, cached.new_block_ids))
        if any(counts):  # left out when no request got a block
            out.num_new_block_ids.extend(counts)
            out.new_block_ids.extend(chain.from_iterable(cached.new_block_ids))
    if so.scheduled_spec_decode_tokens:
        _drafts_to_pb(so.scheduled_spec_decode_tokens, msg.scheduled_spec_decode_tokens)
    return msg


def _drafts_to_pb(drafts: dict[str, list[int]], msg: worker_pb2.DraftTokens) -> None:
    msg.request_ids.extend(drafts)
    msg.num_token_ids.extend(map(len, drafts.values()))
    msg.token_ids.extend(chain.from_iterable(drafts.values()))


def _drafts_from_pb(msg: worker_pb2.DraftTokens) -> dict[str, list[int]]:
    """The draft columns as {request id: drafts}; ValueError when they do not add up, a request
    appears twice or has none."""
    if not msg.request_ids and not msg.token_ids and not msg.num_token_ids:
        return {}
    drafts = dict(zip(msg.request_ids, _runs(msg.token_ids, msg.num_token_ids, len(msg.request_ids), "draft token")))
    if len(drafts) != len(msg.request_ids) or not all(msg.num_token_ids):
        raise ValueError("a step's draft tokens name a request twice or give one none")
    return drafts


def scheduler_output_from_pb(msg: worker_pb2.StepRequest) -> SchedulerOutput:
    """The step's diff as the model runner takes it (sampling parameters are trusted: validated at
    the gateway)."""
    num_scheduled: dict[str, int] = {}
    new_reqs = []
    for r in msg.scheduled_new_reqs:
        new_reqs.append(NewRequestData(
            request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids),
            output_token_ids=list(r.output_token_ids),
            sampling_params=sampling_params_from_pb(r.sampling_params, trusted=True),
            block_ids=list(r.block_ids), num_computed_tokens=r.num_computed_tokens))
        num_scheduled[r.request_id] = r.num_scheduled_tokens
    columns = msg.scheduled_cached_reqs
    req_ids = list(columns.request_ids)
    num_scheduled.update(zip(req_ids, columns.num_scheduled_tokens))
    if columns.num_new_block_ids:
        new_block_ids = _runs(columns.new_block_ids, columns.num_new_block_ids, len(req_ids), "block id", NO_BLOCK_IDS)
    else:
        new_block_ids = [NO_BLOCK_IDS] * len(req_ids)
    cached = CachedRequestData(req_ids, new_block_ids, list(columns.num_computed_tokens))
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_ids=set(msg.finished_req_ids), preempted_req_ids=set(msg.preempted_req_ids),
        scheduled_spec_decode_tokens=_drafts_from_pb(msg.scheduled_spec_decode_tokens),
        continuation=msg.continuation, num_own_drafts=msg.num_own_drafts)


def runner_output_to_pb(output: ModelRunnerOutput, step_id: int, execute_seconds: float
                        ) -> worker_pb2.StepResponse:
    msg = worker_pb2.StepResponse(step_id=step_id, execute_seconds=execute_seconds)
    sampled = output.sampled_token_ids
    if sampled:
        out = msg.sampled
        out.request_ids.extend(sampled)
        tokens = sampled.values()
        counts = list(map(len, tokens))
        if counts.count(1) != len(counts):  # left out when every request sampled one token
            out.num_token_ids.extend(counts)
        out.token_ids.extend(chain.from_iterable(tokens))
        for rid, entries in output.logprobs.items():
            logprobs_to_pb(entries, out.logprobs.add(request_id=rid).logprobs)
    for rid, (first_index, items) in output.prompt_logprobs.items():
        logprobs_to_pb(items, msg.prompt_logprobs.add(request_id=rid, first_index=first_index).logprobs)
    if output.spec_token_ids:
        _drafts_to_pb(output.spec_token_ids, msg.spec_token_ids)
    return msg


def runner_output_from_pb(msg: worker_pb2.StepResponse) -> ModelRunnerOutput:
    columns = msg.sampled
    request_ids, counts, token_ids = columns.request_ids, columns.num_token_ids, columns.token_ids
    if not counts:  # one token each: the usual step
        if len(request_ids) != len(token_ids):
            raise ValueError(f"a step's answer names {len(request_ids)} requests and {len(token_ids)} tokens")
        sampled = {rid: [token] for rid, token in zip(request_ids, token_ids)}
    else:
        sampled = dict(zip(request_ids, _runs(token_ids, counts, len(request_ids), "token")))
    logprobs = {entry.request_id: logprobs_from_pb(entry.logprobs) for entry in columns.logprobs}
    prompt = {p.request_id: (p.first_index, logprobs_from_pb(p.logprobs)) for p in msg.prompt_logprobs}
    return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt,
                             spec_token_ids=_drafts_from_pb(msg.spec_token_ids))
