"""The records of the Redis request and output streams (queue.proto), as to/from pairs: an
EngineRequest (``RequestRecord``: a gateway writes it, a scheduler reads it) and an EngineOutput
(``OutputRecord``: a scheduler writes it, from a step's ``EngineCoreOutput`` or as a refusal;
gateways read it, and so does a scheduler taking a request over, for what was delivered). Where these records live in Redis is ``servicekit.redis_layout``.
"""

from __future__ import annotations

import grpc

from servicekit.contract.records import OutputRecord, RequestRecord
from servicekit.contract.step import EngineCoreOutput
from servicekit.proto.pb import queue_pb2
from servicekit.proto.sampling import (
    FINISH_REASON_FROM_PB,
    FINISH_REASON_TO_PB,
    logprobs_from_pb,
    logprobs_to_pb,
    sampling_params_from_pb,
    sampling_params_to_pb,
)

_STATUS_NUMBER = {code.name: code.value[0] for code in grpc.StatusCode}
_STATUS_NAME = {number: name for name, number in _STATUS_NUMBER.items()}


def request_record_to_bytes(record: RequestRecord) -> bytes:
    msg = queue_pb2.EngineRequest(
        request_id=record.request_id, prompt_token_ids=record.prompt_token_ids, arrival_time=record.arrival_time,
        deadline=record.deadline, priority=record.priority, cache_salt=record.cache_salt, tenant=record.tenant,
        tenant_weight=record.tenant_weight)
    sampling_params_to_pb(record.sampling_params, msg.sampling_params)
    return msg.SerializeToString()


def request_record_from_bytes(data: bytes) -> RequestRecord:
    """The record as the gateway wrote it; its sampling parameters are trusted (validated at
    admission). Raises google.protobuf's DecodeError on bytes that are no EngineRequest."""
    msg = queue_pb2.EngineRequest.FromString(data)
    return RequestRecord(
        msg.request_id, list(msg.prompt_token_ids), sampling_params_from_pb(msg.sampling_params, trusted=True),
        arrival_time=msg.arrival_time, deadline=msg.deadline, priority=msg.priority, cache_salt=msg.cache_salt,
        tenant=msg.tenant, tenant_weight=msg.tenant_weight)


def _output_msg(token_ids, first_index: int, finish_reason, num_cached_tokens: int, logprobs, prompt_logprobs
                ) -> queue_pb2.EngineOutput:
    msg = queue_pb2.EngineOutput(
        token_ids=token_ids, first_index=first_index, finish_reason=FINISH_REASON_TO_PB[finish_reason],
        num_cached_tokens=num_cached_tokens)
    if logprobs:
        logprobs_to_pb(logprobs, msg.logprobs)
    if prompt_logprobs:
        logprobs_to_pb(prompt_logprobs, msg.prompt_logprobs)
    return msg


def output_record_to_bytes(record: OutputRecord) -> bytes:
    msg = _output_msg(record.token_ids, record.first_index, record.finish_reason, record.num_cached_tokens,
                      record.logprobs, record.prompt_logprobs)
    if record.error_message:
        msg.error_field = record.error_field
        msg.error_message = record.error_message
        msg.error_code = _STATUS_NUMBER[record.error_code]
    return msg.SerializeToString()


def engine_output_to_bytes(out: EngineCoreOutput) -> bytes:
    """The record of what one step produced for one request, as the scheduler publishes it (read
    back by ``output_record_from_bytes``): ``output_record_to_bytes`` without making an
    OutputRecord first, once per request a step."""
    return _output_msg(out.new_token_ids, out.first_index, out.finish_reason, out.num_cached_tokens,
                       out.new_logprobs, out.prompt_logprobs).SerializeToString()


def output_record_from_bytes(data: bytes) -> OutputRecord:
    """One per token a gateway streams: the fields of a normal record are read once each, and an
    error record's (rare) only when it is one."""
    msg = queue_pb2.EngineOutput.FromString(data)
    logprobs, prompt_logprobs = msg.logprobs, msg.prompt_logprobs
    record = OutputRecord(list(msg.token_ids), msg.first_index, logprobs_from_pb(logprobs) if logprobs else [],
                          FINISH_REASON_FROM_PB[msg.finish_reason], msg.num_cached_tokens,
                          prompt_logprobs=logprobs_from_pb(prompt_logprobs) if prompt_logprobs else [])
    message = msg.error_message
    if message:
        record.error_field, record.error_message = msg.error_field, message
        record.error_code = _STATUS_NAME[msg.error_code]
    return record
