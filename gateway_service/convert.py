"""The gateway's half of the public API (generation.proto): a Generate or Tokenize call's input,
validated, and the chunks it streams. What the SDK builds and the gateway reads the same way
(chats, usage, model facts) is ``servicekit.proto.generation``; the Redis records are
``servicekit.proto.queue``. Nothing else in the gateway touches ``*_pb2``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace

from gateway_service.messages import GenerateChunk, GenerateInput, checked_user
from gateway_service.tool_calls import ToolChoice, constraint, parse_tools, render_turn, with_tools
from servicekit.contract.errors import InvalidArgumentError
from servicekit.proto.generation import chat_from_pb, usage_to_pb
from servicekit.proto.pb import generation_pb2, sampling_pb2
from servicekit.sampling_defaults import unset_filled
from servicekit.proto.sampling import FINISH_REASON_TO_PB, logprobs_to_pb, sampling_params_from_pb


def generate_input_from_pb(msg: generation_pb2.GenerateRequest,
                           sampling_defaults: Mapping[str, float] | None = None) -> GenerateInput:
    """Raises InvalidArgumentError naming the first bad field. ``sampling_defaults``: what the
    sampling fields the message leaves unset take (``servicekit.sampling_defaults``)."""
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidArgumentError("prompt", "one of prompt, chat or prompt_token_ids is required")
    sampling = msg.sampling_params
    unset = {name: value for name, value in (sampling_defaults or {}).items() if not sampling.HasField(name)}
    if unset:
        sampling = sampling_pb2.SamplingParams()
        sampling.CopyFrom(msg.sampling_params)
        for name, value in unset_filled({}, unset).items():
            setattr(sampling, name, value)
    params = sampling_params_from_pb(sampling)
    messages, tools = chat_turns_from_pb(msg.chat) if which == "chat" else (None, None)
    tool_constraint = constraint(tools) if tools is not None else None
    if tool_constraint is not None:  # a required or named choice: the calls' JSON, by construction
        if params.structured_output is not None:
            raise InvalidArgumentError("tool_choice", "a required or named tool choice constrains the output: "
                                                           "it cannot be combined with structured_output")
        params = replace(params, structured_output=tool_constraint)
    return GenerateInput(
        sampling_params=params, tools=tools,
        prompt=msg.prompt if which == "prompt" else None,
        messages=messages,
        prompt_token_ids=list(msg.prompt_token_ids.ids) if which == "prompt_token_ids" else None,
        model=msg.model, request_id=msg.request_id,
        resume_from_index=msg.resume_from_index if msg.HasField("resume_from_index") else None,
        priority=msg.priority, cache_salt=msg.cache_salt, user=checked_user(msg.user),
        include_special_tokens=msg.include_special_tokens,
        truncate_prompt_tokens=msg.truncate_prompt_tokens if msg.HasField("truncate_prompt_tokens") else None,
        add_generation_prompt=msg.chat.add_generation_prompt if msg.chat.HasField("add_generation_prompt") else True,
        continue_final_message=msg.chat.continue_final_message)


def chat_turns_from_pb(chat: generation_pb2.Chat) -> tuple[list[dict[str, str]], ToolChoice | None]:
    """A Chat's turns as the chat template takes them (the tools described first, calls and
    results written as the model reads them) and its tools (None: none may be called)."""
    tools = _tools_from_pb(chat)
    turns = [render_turn(i, m["role"], m["content"], m.get("tool_calls")) for i, m in enumerate(chat_from_pb(chat))]
    return (turns if tools is None else with_tools(turns, tools)), tools


def _tools_from_pb(chat: generation_pb2.Chat) -> ToolChoice | None:
    """Chat.tools and its choice, checked as OpenAI's are (gateway_service.tool_calls), errors
    naming the proto's fields."""
    tools = []
    for i, tool in enumerate(chat.tools):
        try:
            parameters = json.loads(tool.parameters) if tool.parameters else None
        except ValueError as exc:
            raise InvalidArgumentError(f"tools[{i}].parameters", f"must be JSON text: {exc}") from None
        tools.append({"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                       "parameters": parameters}})
    if chat.tool_choice_function:
        if chat.tool_choice not in ("", "required"):
            raise InvalidArgumentError("tool_choice", 'must be empty or "required" with tool_choice_function')
        choice = {"type": "function", "function": {"name": chat.tool_choice_function}}
    else:
        choice = chat.tool_choice or None
    body = {"tools": tools, "tool_choice": choice}
    if chat.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = chat.parallel_tool_calls
    try:
        return parse_tools(body)
    except InvalidArgumentError as exc:
        field = exc.field.replace(".function.", ".").replace("tool_choice.name", "tool_choice_function")
        raise InvalidArgumentError(field, exc.message.replace(exc.field, field)) from None


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
    if chunk.tool_calls:
        msg.finish_reason = sampling_pb2.FINISH_REASON_TOOL_CALLS
        for call in chunk.tool_calls:
            msg.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
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
    return msg.model, (msg.text if which == "text" else None), (chat_turns_from_pb(msg.chat)[0] if which == "chat"
                                                                else None)


def tokenize_response_to_pb(token_ids: list[int]) -> generation_pb2.TokenizeResponse:
    return generation_pb2.TokenizeResponse(token_ids=token_ids)
