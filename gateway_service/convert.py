"""Gateway-side protobuf <-> dataclass conversions (generation.proto, queue.proto). Nothing else
in the gateway touches ``*_pb2`` (STYLE.md 5)."""

from __future__ import annotations

import hashlib
from array import array

import grpc

from gateway_service.messages import GenerateChunk, GenerateInput, OutputRecord
from gateway_service.request_queue import RequestDigests
from servicekit.contract.api import ModelInfo
from servicekit.contract.chat import check_chat_message
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams
from servicekit.proto.convert import (
    FINISH_REASON_FROM_PB,
    FINISH_REASON_TO_PB,
    logprobs_from_pb,
    logprobs_to_pb,
    sampling_params_from_pb,
    sampling_params_to_pb,
)
from servicekit.proto.pb import generation_pb2, queue_pb2

# A conversation's turns are bounded before they are copied or rendered (each turn costs template
# tokens, so far more turns than this could not fit any served model's context anyway).
MAX_CHAT_MESSAGES = 1024


def _messages(chat) -> list[dict[str, str]]:
    """The turns of a Chat; raises InvalidArgumentError naming the first bad one
    (``messages`` when there are too many, else ``messages[1].role``)."""
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgumentError("messages", f"at most {MAX_CHAT_MESSAGES} chat messages, got {len(chat.messages)}")
    for i, m in enumerate(chat.messages):
        check_chat_message(i, m.role, m.content)
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def generate_input_from_pb(msg: generation_pb2.GenerateRequest) -> GenerateInput:
    """Raises InvalidArgumentError naming the first bad field."""
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidArgumentError("prompt", "one of prompt, chat or prompt_token_ids is required")
    return GenerateInput(
        sampling_params=sampling_params_from_pb(msg.sampling_params),
        prompt=msg.prompt if which == "prompt" else None,
        messages=_messages(msg.chat) if which == "chat" else None,
        prompt_token_ids=list(msg.prompt_token_ids.ids) if which == "prompt_token_ids" else None,
        model=msg.model, request_id=msg.request_id,
        resume_from_index=msg.resume_from_index if msg.HasField("resume_from_index") else None,
        priority=msg.priority, cache_salt=msg.cache_salt, include_special_tokens=msg.include_special_tokens,
        truncate_prompt_tokens=msg.truncate_prompt_tokens if msg.HasField("truncate_prompt_tokens") else None,
        add_generation_prompt=msg.chat.add_generation_prompt if msg.chat.HasField("add_generation_prompt") else True,
        continue_final_message=msg.chat.continue_final_message)


def chunk_to_pb(chunk: GenerateChunk,
                msg: generation_pb2.GenerateResponse | None = None) -> generation_pb2.GenerateResponse:
    """``chunk`` as a GenerateResponse, written into ``msg`` when given (a field of a larger message,
    filled in place rather than copied in)."""
    if msg is None:
        msg = generation_pb2.GenerateResponse()
    msg.request_id = chunk.request_id
    msg.text = chunk.text
    msg.token_ids.extend(chunk.token_ids)
    msg.first_index = chunk.first_index
    msg.finish_reason = FINISH_REASON_TO_PB[chunk.finish_reason]
    msg.stop_string = chunk.stop_string
    if chunk.stop_token_id is not None:
        msg.stop_token_id = chunk.stop_token_id
    if chunk.logprobs:
        logprobs_to_pb(chunk.logprobs, msg.logprobs)
    if chunk.prompt_logprobs:
        logprobs_to_pb(chunk.prompt_logprobs, msg.prompt_logprobs)
    if chunk.usage is not None:
        u = chunk.usage
        msg.usage.prompt_tokens = u.prompt_tokens
        msg.usage.completion_tokens = u.completion_tokens
        msg.usage.cached_prompt_tokens = u.cached_prompt_tokens
    return msg


def tokenize_input_from_pb(msg: generation_pb2.TokenizeRequest) -> tuple[str, str | None, list | None]:
    """(model, text, messages)."""
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidArgumentError("text", "one of text or chat is required")
    return msg.model, (msg.text if which == "text" else None), (_messages(msg.chat) if which == "chat" else None)


def tokenize_response_to_pb(token_ids: list[int]) -> generation_pb2.TokenizeResponse:
    return generation_pb2.TokenizeResponse(token_ids=token_ids)


def model_info_to_pb(limits: ModelInfo) -> generation_pb2.ModelInfoResponse:
    return generation_pb2.ModelInfoResponse(
        model=limits.model, max_model_len=limits.max_model_len, vocab_size=limits.vocab_size,
        eos_token_ids=list(limits.eos_token_ids), num_workers=limits.num_workers, block_size=limits.block_size)


# -- Redis records ------------------------------------------------------------------------------------


def request_digests(prompt_token_ids: list[int], params: SamplingParams) -> RequestDigests:
    """Digests of what a resume must repeat; the params' deterministic wire form is hashed, so
    equal parameters give equal digests on any gateway."""
    prompt = hashlib.sha256(array("I", prompt_token_ids).tobytes()).hexdigest()[:32]
    wire = sampling_params_to_pb(params).SerializeToString(deterministic=True)
    return RequestDigests(prompt=prompt, params=hashlib.sha256(wire).hexdigest()[:32])


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def engine_request_to_record(request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                             arrival_time: float, deadline: float, priority: int, cache_salt: str) -> bytes:
    msg = queue_pb2.EngineRequest(
        request_id=request_id, prompt_token_ids=prompt_token_ids, arrival_time=arrival_time,
        deadline=deadline, priority=priority, cache_salt=cache_salt)
    sampling_params_to_pb(params, msg.sampling_params)
    return msg.SerializeToString()


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
        code = _STATUS_BY_NUMBER[msg.error_code].name if msg.error_code in _STATUS_BY_NUMBER else None
        if code is None:  # written before records carried their code
            code = "INVALID_ARGUMENT" if msg.error_field else "ABORTED"
        record.error_field, record.error_message, record.error_code = msg.error_field, message, code
    return record
