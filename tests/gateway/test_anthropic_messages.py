"""Anthropic's Messages API on the gateway's HTTP server: the parser (pure: turns, tools, sampling
defaults, refusals by name), then the official ``anthropic`` client against the in-process stack
(whole and streamed messages, system prompt, stop reasons, tool use round trips, count_tokens, and
errors in Anthropic's shape, an API key sent as ``x-api-key`` included)."""

from __future__ import annotations

import asyncio

import anthropic
import jsonschema
import openai
import pytest

from gateway_service.anthropic_messages import error_body, parse_count_tokens, parse_message
from servicekit.contract import errors
from servicekit.contract.errors import InvalidArgumentError

from helpers.stack import post_json, queue_limited_gateway

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
TOOLS = [{"name": "get_weather", "description": "The forecast", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


def body(**fields) -> dict:
    return {"max_tokens": 8, "messages": ASK, **fields}


# -- the parser --------------------------------------------------------------------------------------

def test_system_blocks_and_tool_turns_render_as_the_chat_api_renders_them():
    req = parse_message(body(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                             messages=[*ASK, {"role": "assistant", "content": [
                                 {"type": "text", "text": "Let me look."},
                                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                  "input": {"city": "Paris", "days": 3}}]},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                               "content": [{"type": "text", "text": "Sunny"}]},
                                                              {"type": "text", "text": "And tomorrow?"}]}],
                             tools=TOOLS))
    turns = req.input.messages
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.\nBe kind.\n\n") and "<tools>" in turns[0]["content"]
    assert turns[2]["content"] == ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Paris", "days": 3}}\n</tool_call>')
    assert turns[3]["content"] == "<tool_response>\nSunny\n</tool_response>\nAnd tomorrow?"
    assert req.input.tools.choice == "auto" and req.input.add_generation_prompt
    assert req.message_id == "msg_" + req.input.request_id


def test_a_final_assistant_message_is_continued():
    prefill = parse_message(body(messages=[*ASK, {"role": "assistant", "content": "The forecast:"}])).input
    assert prefill.continue_final_message and not prefill.add_generation_prompt
    empty = parse_message(body(messages=[*ASK, {"role": "assistant", "content": ""}])).input
    assert empty.add_generation_prompt and [t["role"] for t in empty.messages] == ["user"]


@pytest.mark.parametrize(("choice", "ours"), [
    ({"type": "auto"}, ("auto", "", True)),
    ({"type": "any"}, ("required", "", True)),
    ({"type": "any", "disable_parallel_tool_use": True}, ("required", "", False)),
    ({"type": "tool", "name": "get_time"}, ("function", "get_time", False)),
])
def test_tool_choices_map_onto_the_chat_apis(choice, ours):
    tools = parse_message(body(tools=TOOLS, tool_choice=choice)).input.tools
    assert (tools.choice, tools.name, tools.parallel) == ours
    none = parse_message(body(tools=TOOLS, tool_choice={"type": "none"})).input
    assert none.tools is None and "<tools>" not in none.messages[0]["content"]


def test_unset_sampling_fields_take_the_defaults_and_sent_ones_stay():
    defaults = {"temperature": 0.0, "top_k": 20.0, "min_p": 0.05}
    filled = parse_message(body(), defaults).input.sampling_params
    assert (filled.temperature, filled.top_k, filled.min_p) == (0.0, 20, 0.05)
    sent = parse_message(body(temperature=0.7, top_k=5, top_p=0.9), defaults).input.sampling_params
    assert (sent.temperature, sent.top_k, sent.top_p, sent.min_p) == (0.7, 5, 0.9, 0.05)
    stop = parse_message(body(stop_sequences=["\n\n", "END"])).input.sampling_params.stop
    assert stop == ("\n\n", "END")


def test_count_tokens_renders_the_chat_the_message_would():
    fields = dict(system="Be brief.", messages=ASK, tools=TOOLS, tool_choice={"type": "any"})
    model, counted = parse_count_tokens({"model": "m", **fields})
    sent = parse_message({"max_tokens": 4, **fields}).input
    assert model == "m"
    assert (counted.messages, counted.add_generation_prompt, counted.continue_final_message) == \
        (sent.messages, sent.add_generation_prompt, sent.continue_final_message)


@pytest.mark.parametrize(("fields", "field"), [
    (dict(max_tokens=None), "max_tokens"),
    (dict(max_tokens="8"), "max_tokens"),
    (dict(foo=1), "foo"),
    (dict(n=2), "n"),
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    (dict(service_tier="priority"), "service_tier"),
    (dict(metadata={"user_id": 7}), "metadata.user_id"),
    (dict(metadata={"user_id": "u" * 257}), "metadata.user_id"),
    (dict(metadata={"tags": ["a"]}), "metadata.tags"),
    (dict(stop_sequences="END"), "stop_sequences"),
    (dict(stop_sequences=[1]), "stop_sequences"),
    (dict(temperature="hot"), "temperature"),
    (dict(system=7), "system"),
    (dict(system=[{"type": "image"}]), "system[0].type"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": "x", "name": "bob"}]), "messages[0].name"),
    (dict(messages=[{"role": "user"}]), "messages[0].content"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages[0].content[0].type"),
    (dict(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
     "messages[0].content[0].type"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]),
     "messages[0].content[0].citations"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
     "messages[0].content[0].type"),
    (dict(messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": "{}"}]}]),
     "messages[0].content[0].input"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": 1}]}]),
     "messages[0].content[0].is_error"),
    (dict(tools={"name": "f"}), "tools"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (dict(tools=[{"name": "f"}]), "tools[0].input_schema"),
    (dict(tools=[{"name": "has space", "input_schema": TIME}]), "tools[0].name"),
    (dict(tools=[{"name": "f", "input_schema": []}]), "tools[0].input_schema"),
    (dict(tools=[{"name": "f", "description": 3, "input_schema": TIME}]), "tools[0].description"),
    (dict(tools=[{"name": "f", "input_schema": TIME, "strict": True}]), "tools[0].strict"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools"),
    (dict(tools=TOOLS, tool_choice="any"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "required"}), "tool_choice.type"),
    (dict(tools=TOOLS, tool_choice={"type": "tool"}), "tool_choice.name"),
    (dict(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
    (dict(tools=TOOLS, tool_choice={"type": "auto", "name": "get_time"}), "tool_choice.name"),
    (dict(tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": "yes"}),
     "tool_choice.disable_parallel_tool_use"),
    (dict(tool_choice={"type": "any"}), "tool_choice"),
])
def test_bad_bodies_are_refused_by_name(fields, field):
    with pytest.raises(InvalidArgumentError) as caught:
        parse_message({k: v for k, v in body(**fields).items() if v is not None})
    assert caught.value.field == field


def test_off_values_are_accepted():
    parse_message(body(thinking={"type": "disabled"}, service_tier="standard_only", metadata={"user_id": "u-1"},
                       system=[{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]))


@pytest.mark.parametrize(("error", "status", "kind"), [
    (InvalidArgumentError("max_tokens", "required"), 400, "invalid_request_error"),
    (errors.UnauthenticatedError("invalid API key"), 401, "authentication_error"),
    (errors.NotFoundError("no such model"), 404, "not_found_error"),
    (errors.ResourceExhaustedError("queue full"), 429, "rate_limit_error"),
    (errors.UnavailableError("draining"), 529, "overloaded_error"),
    (errors.InternalError("boom"), 500, "api_error"),
    (errors.DeadlineExceededError("late"), 504, "api_error"),
])
def test_typed_errors_take_anthropics_types_and_statuses(error, status, kind):
    assert error_body(error) == (status, {"type": "error", "error": {"type": kind, "message": str(error)}})


# -- against the stack -------------------------------------------------------------------------------

# The SDK's newer releases take no sampling fields as arguments (the newest Claude models take none);
# a client sends them in the body, as here.
GREEDY = {"extra_body": {"temperature": 0}}


def client(stack) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=stack.http_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                                    timeout=60)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_whole_and_streamed_messages_agree_and_match_the_chat_api(stack):
    fields = dict(model=stack.model, max_tokens=20, **GREEDY, system="Be brief.",
                  messages=[{"role": "user", "content": "Tell me a story"}])
    async with client(stack) as c:
        whole = await c.messages.create(**fields)
        async with c.messages.stream(**fields) as stream:
            streamed_text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        raw = [event.type async for event in await c.messages.create(stream=True, **fields)]
    async with openai.AsyncOpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=60) as o:
        chat = await o.chat.completions.create(model=stack.model, max_tokens=20, temperature=0, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}])

    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == stack.model
    assert text_of(whole) == streamed_text == text_of(final) == chat.choices[0].message.content
    assert whole.stop_reason == final.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length"
                                                      else "end_turn")
    assert whole.usage.input_tokens == final.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == final.usage.output_tokens == chat.usage.completion_tokens
    assert raw[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[3:-3]) <= {"content_block_delta"}


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_max_tokens_and_stop_sequences_give_anthropics_stop_reasons(stack):
    fields = dict(model=stack.model, **GREEDY, messages=[{"role": "user", "content": "Count to ten"}])
    async with client(stack) as c:
        capped = await c.messages.create(max_tokens=12, **fields)
        text = text_of(capped)
        assert capped.stop_reason == "max_tokens" and capped.stop_sequence is None
        assert capped.usage.output_tokens == 12 and len(text) > 6
        stop = text[4:7]
        stopped = await c.messages.create(max_tokens=12, stop_sequences=[stop], **fields)
        async with c.messages.stream(max_tokens=12, stop_sequences=[stop], **fields) as stream:
            streamed = await stream.get_final_message()
    for message in (stopped, streamed):
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
        assert text_of(message) == text[:text.index(stop)]


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}], ids=["any", "tool"])
async def test_tool_use_round_trip(stack, choice):
    """A forced choice answers with ``tool_use`` blocks whose input validates; streamed, the same
    blocks; the conversation with the calls and a ``tool_result`` then continues."""
    fields = dict(model=stack.model, max_tokens=200, **GREEDY, messages=ASK, tools=TOOLS, tool_choice=choice)
    async with client(stack) as c:
        reply = await c.messages.create(**fields)
        async with c.messages.stream(**fields) as stream:
            final = await stream.get_final_message()
        assert reply.stop_reason == final.stop_reason == "tool_use"
        calls = [block for block in reply.content if block.type == "tool_use"]
        assert calls and all(call.id.startswith("toolu_") for call in calls)
        for call in calls:
            jsonschema.validate(call.input, SCHEMAS[call.name])
        if choice["type"] == "tool":
            assert [call.name for call in calls] == ["get_time"]
        def blocks(message) -> list[dict]:  # ids differ: each is derived from its own request's
            return [b.model_dump(exclude={"id"}) for b in message.content]
        assert blocks(final) == blocks(reply)
        history = [*ASK, {"role": "assistant", "content": [block.model_dump() for block in reply.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}
                                                for call in calls]}]
        answer = await c.messages.create(model=stack.model, max_tokens=8, **GREEDY, messages=history, tools=TOOLS)
        counted = await c.messages.count_tokens(model=stack.model, messages=history, tools=TOOLS)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert counted.input_tokens == answer.usage.input_tokens > reply.usage.input_tokens


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_count_tokens_equals_the_input_tokens_a_message_reports(stack):
    fields = dict(model=stack.model, system=[{"type": "text", "text": "Be brief."}], tools=TOOLS,
                  messages=[*ASK, {"role": "assistant", "content": "The forecast:"}])
    async with client(stack) as c:
        counted = await c.messages.count_tokens(**fields)
        reply = await c.messages.create(max_tokens=4, **GREEDY, **fields)
        plain = await c.messages.count_tokens(model=stack.model, messages=ASK)
    assert counted.input_tokens == reply.usage.input_tokens > plain.input_tokens > 0


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_errors_come_in_anthropics_shape(stack):
    url = stack.http_url + "/messages"
    status, missing = await asyncio.to_thread(post_json, url, {"model": stack.model, "messages": ASK})
    assert status == 400 and missing["type"] == "error"
    assert missing["error"]["type"] == "invalid_request_error" and "max_tokens" in missing["error"]["message"]
    status, not_json = await asyncio.to_thread(post_json, url + "/count_tokens", [1])
    assert status == 400 and not_json["error"]["type"] == "invalid_request_error"
    status, no_route = await asyncio.to_thread(post_json, url + "/batches", {})
    assert status == 404 and no_route["error"]["type"] == "not_found_error"
    async with client(stack) as c:
        with pytest.raises(anthropic.BadRequestError) as unknown:
            await c.messages.create(model=stack.model, max_tokens=4, messages=ASK, extra_body={"foo": 1})
        with pytest.raises(anthropic.BadRequestError) as role:
            await c.messages.create(model=stack.model, max_tokens=4, messages=[{"role": "system", "content": "x"}])
        with pytest.raises(anthropic.BadRequestError) as thinking:
            await c.messages.create(model=stack.model, max_tokens=2048, messages=ASK,
                                    thinking={"type": "enabled", "budget_tokens": 1024})
        with pytest.raises(anthropic.NotFoundError) as model:
            await c.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
        with pytest.raises(anthropic.BadRequestError) as too_long:  # refused at admission: before any event
            await c.messages.create(model=stack.model, max_tokens=100_000, messages=ASK, stream=True)
    for caught, name in ((unknown, "foo"), (role, "messages[0].role"), (thinking, "thinking"),
                         (too_long, "max_tokens")):
        assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
        assert caught.value.body["error"]["message"].startswith(name + ":")
    assert model.value.status_code == 404 and model.value.body["error"]["type"] == "not_found_error"
    status, openai_shaped = await asyncio.to_thread(post_json, stack.http_url + "/chat/completions",
                                                   {"messages": ASK, "foo": 1})
    assert status == 400 and openai_shaped["error"]["param"] == "foo"  # the OpenAI routes keep theirs


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_an_api_key_is_taken_from_x_api_key(stack, hf_tokenizer):
    async with queue_limited_gateway(stack, hf_tokenizer, "anthropic-keys:", 4, api_keys=("right-key",)) as (
            gateway, _redis, _keys):
        base = f"http://127.0.0.1:{gateway.http_port}"
        async with anthropic.AsyncAnthropic(base_url=base, api_key="wrong-key", max_retries=0, timeout=30) as wrong:
            with pytest.raises(anthropic.AuthenticationError) as caught:
                await wrong.messages.create(model=stack.model, max_tokens=4, messages=ASK)
        async with anthropic.AsyncAnthropic(base_url=base, api_key="right-key", max_retries=0, timeout=30) as right:
            counted = await right.messages.count_tokens(model=stack.model, messages=ASK)
        async with anthropic.AsyncAnthropic(base_url=base, auth_token="right-key", max_retries=0, timeout=30) as bearer:
            assert (await bearer.messages.count_tokens(model=stack.model, messages=ASK)).input_tokens == \
                counted.input_tokens > 0
    assert caught.value.status_code == 401
    assert caught.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                            "message": "invalid API key"}}
