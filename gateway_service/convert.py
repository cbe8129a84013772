"""The gateway's half of the public API (generation.proto): a Generate or Tokenize call's input,
validated, and the chunks it streams. What the SDK builds and the gateway reads the same way
(chats, usage, model facts) is ``servicekit.proto.generation``; the Redis records are
``servicekit.proto.queue``. Nothing else in the gateway touches ``*_pb2``."""

from __future__ import annotations

from gateway_service.messages import GenerateChunk, GenerateInput
from servicekit.contract.errors import InvalidArgumentError
from servicekit.proto.generation import chat_from_pb, usage_to_pb
from servicekit.proto.pb import generation_pb2
from servicekit.proto.sampling import FINISH_REASON_TO_PB, logprobs_to_pb, sampling_params_from_pb


def generate_input_from_pb(msg: generation_pb2.GenerateRequest) -> GenerateInput:
    """Raises InvalidArgumentError naming the first bad field."""
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidArgumentError("prompt", "one of prompt, chat or prompt_token_ids is required")
    return GenerateInput(
        sampling_params=sampling_params_from_pb(msg.sampling_params),
        prompt=msg.prompt if which == "prompt" else None,
        messages=chat_from_pb(msg.chat) if which == "chat" else None,
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
        usage_to_pb(chunk.usage, msg.usage)
    return msg


def tokenize_input_from_pb(msg: generation_pb2.TokenizeRequest) -> tuple[str, str | None, list | None]:
    """(model, text, messages)."""
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidArgumentError("text", "one of text or chat is required")
    return msg.model, (msg.text if which == "text" else None), (chat_from_pb(msg.chat) if which == "chat" else None)


def tokenize_response_to_pb(token_ids: list[int]) -> generation_pb2.TokenizeResponse:
    return generation_pb2.TokenizeResponse(token_ids=token_ids)
