"""Tool calling: ``tools`` and ``tool_choice`` read and checked by name, the answer read into
``tool_calls`` as it streams (pure: the parsers, the constraint, the reader and its resumes), and the
whole path against the in-process stack, with the official ``openai`` client over HTTP and with the
SDK over gRPC (required and named choices give calls whose arguments validate; auto parses a
call-shaped answer; a streamed call reassembles to the whole one; a resumed stream brings the same
calls; a conversation with calls and results in it is accepted)."""

from __future__ import annotations

import json
import random
from typing import Literal

import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from gateway_service.openai_params import parse_chat
from gateway_service.text import PromptTokenizer
from gateway_service.tool_calls import ToolCallReader, ToolChoice, constraint, held_back, parse_answer, parse_tools
from pagedserve.aio_client import AsyncClient
from servicekit.contract.errors import InvalidArgumentError

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


def tools_of(**body) -> ToolChoice | None:
    return parse_tools({"tools": TOOLS, **body})


def test_tool_choice_forms():
    assert tools_of().choice == "auto" and tools_of().parallel
    assert tools_of(tool_choice="none") is None
    assert tools_of(tool_choice="required", parallel_tool_calls=False).parallel is False
    named = tools_of(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.choice, named.name) == ("function", "get_time")


@pytest.mark.parametrize(("body", "field"), [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_refused_by_name(body, field):
    with pytest.raises(InvalidArgumentError) as caught:
        parse_chat({"messages": ASK, **body})
    assert caught.value.field == field


def test_required_and_named_choices_constrain_to_the_calls_json():
    required = json.loads(constraint(tools_of(tool_choice="required")).spec)
    assert required["type"] == "array" and len(required["items"]["anyOf"]) == 2
    named = json.loads(constraint(tools_of(tool_choice={"type": "function", "function": {"name": "get_time"}})).spec)
    assert named["properties"]["name"] == {"enum": ["get_time"]} and named["properties"]["arguments"] == TIME
    assert constraint(tools_of()) is None  # auto: the model writes freely


def test_answers_are_read_into_calls_and_content():
    auto = tools_of()
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
    answer = parse_answer(text, auto)
    assert answer.content == "Let me look." and answer.calls == [("get_weather", '{"city": "Rome", "days": 2}')]
    two = parse_answer('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
                       '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>', auto)
    assert two.content is None and [c[1] for c in two.calls] == ['{"zone": "UTC"}', '{"zone": "CET"}']
    # not a call of these tools: content
    assert parse_answer('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', auto).calls == []
    assert parse_answer("Just text.", auto).content == "Just text."
    as_json = parse_answer('{"name": "get_time", "parameters": {"zone": "EST"}}', auto, "json")
    assert as_json.calls == [("get_time", '{"zone": "EST"}')]
    required = parse_answer('[{"name": "get_time", "arguments": {"zone": "UTC"}}]', tools_of(tool_choice="required"))
    assert required.calls == [("get_time", '{"zone": "UTC"}')]


def test_streamed_text_is_held_back_where_a_call_may_begin():
    auto = tools_of()
    assert held_back("Hello there", auto) == len("Hello there")
    assert held_back("Hello <tool", auto) == len("Hello")  # and the space, which a call would trim
    assert held_back("Hello\n", auto) == len("Hello")
    assert held_back("Hi <tool_call>{", auto) == len("Hi")
    assert held_back('{"name"', tools_of(tool_choice="required")) == 0


ANSWERS = [
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>',
    'Two: <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call> done',
    "No call here <tool but a broken tag <tool_call>{not json",
    "Plain text, ending in whitespace \n",
]


def read_stream(reader: ToolCallReader, pieces: list[str], *, stopped: bool = True):
    sent = [reader.read(p) for p in pieces[:-1]]
    rest, calls = reader.finish(pieces[-1], stopped=stopped)
    return "".join(sent) + rest, calls


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_streamed_answer_reads_as_the_whole_one_and_resumes_from_any_piece(answer):
    """However the text is cut into chunks, the content streamed joins to the whole answer's content,
    with the same calls (same ids); and a resumed stream (the text before its resume point skipped)
    sends exactly what the interrupted one had still to send."""
    auto = tools_of()
    whole = parse_answer(answer, auto)
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(answer)), rng.randint(1, 8)))
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
        content, calls = read_stream(ToolCallReader(auto, "r-1"), pieces)
        assert content == (whole.content or "")
        assert [(c.name, c.arguments) for c in calls] == whole.calls
        first = ToolCallReader(auto, "r-1")
        sent = [first.read(p) for p in pieces[:-1]]
        for k in range(1, len(pieces)):  # the client had pieces[:k] and what they released
            resumed = ToolCallReader(auto, "r-1")
            resumed.skip("".join(pieces[:k]))
            rest, again = read_stream(resumed, pieces[k:])
            assert "".join(sent[:k]) + rest == content and again == calls
    # cut off (max_tokens): all of it is content, no calls
    assert read_stream(ToolCallReader(auto, "r-1"), [answer], stopped=False) == (answer, [])


def test_a_conversation_with_calls_and_results_renders_them_as_text():
    (inp,) = parse_chat({"messages": [
        *ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}], "tools": TOOLS}).inputs
    roles = [m["role"] for m in inp.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert "get_weather" in inp.messages[0]["content"] and "<tools>" in inp.messages[0]["content"]
    assert '"arguments": {"city": "Paris", "days": 3}' in inp.messages[2]["content"]
    assert inp.messages[3]["content"] == "<tool_response>\nSunny, 24 C\n</tool_response>"


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
    """The forecast for a city."""
    return "sunny"


# -- over HTTP ---------------------------------------------------------------------------------------


def client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=60)


def assert_valid_calls(message) -> None:
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
async def test_required_and_named_choices_return_valid_calls(stack, choice):
    async with client(stack) as c:
        reply = await c.chat.completions.create(model=stack.model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                max_tokens=200, temperature=0)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(reply.choices[0].message)
    if isinstance(choice, dict):
        assert [call.function.name for call in reply.choices[0].message.tool_calls] == ["get_time"]


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_auto_reads_a_call_shaped_answer(stack):
    shaped = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'
    async with client(stack) as c:
        reply = await c.chat.completions.create(model=stack.model, messages=ASK, tools=TOOLS, max_tokens=80,
                                                temperature=0, extra_body={"guided_regex": shaped})
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    assert_valid_calls(reply.choices[0].message)


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_a_streamed_call_reassembles_to_the_whole_one(stack):
    body = dict(model=stack.model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    async with client(stack) as c:
        whole = await c.chat.completions.create(**body)
        calls: dict[int, dict] = {}
        finish = None
        async for chunk in await c.chat.completions.create(stream=True, **body):
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(delta_call.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = delta_call.id or call["id"]
                if delta_call.function is not None:
                    call["name"] = delta_call.function.name or call["name"]
                    call["arguments"] += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    want = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
            for t in whole.choices[0].message.tool_calls]
    assert [calls[k] for k in sorted(calls)] == [{**w, "id": calls[k]["id"]} for k, w in enumerate(want)]


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_a_conversation_with_results_is_answered(stack):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]
    async with client(stack) as c:
        reply = await c.chat.completions.create(model=stack.model, messages=messages, tools=TOOLS, tool_choice="none",
                                                max_tokens=8, temperature=0)
        with pytest.raises(openai.BadRequestError) as caught:
            await c.chat.completions.create(model=stack.model, messages=ASK, tools=TOOLS, max_tokens=8,
                                            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
    assert caught.value.body["param"] == "tool_choice.function.name"


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_langchain_structured_output_and_bound_tools_work(stack):
    """langchain-openai's two agent entry points against the server: ``with_structured_output``
    (response_format json_schema from a pydantic model) and ``bind_tools`` (tools, a required choice)."""
    chat = ChatOpenAI(base_url=stack.http_url, api_key="unused", model=stack.model, temperature=0, max_tokens=200,
                      max_retries=0, timeout=60)
    forecast = await chat.with_structured_output(Forecast, method="json_schema").ainvoke("The weather in Rome?")
    assert isinstance(forecast, Forecast)

    message = await chat.bind_tools([get_weather], tool_choice="required").ainvoke("The weather in Oslo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert set(message.tool_calls[0]["args"]) == {"city", "days"}


# -- over gRPC, with the SDK -------------------------------------------------------------------------

SDK_TOOLS = [{"name": "get_weather", "description": "The forecast", "parameters": WEATHER},
             {"name": "get_time", "parameters": TIME}]
SHAPED = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'


def assert_valid_sdk_calls(completion) -> None:
    assert completion.finish_reason == "tool_calls" and completion.tool_calls
    for call in completion.tool_calls:
        assert call.id.startswith("call_")
        jsonschema.validate(call.args, SCHEMAS[call.name])


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_sdk_required_and_named_choices_return_valid_calls(stack):
    async with AsyncClient(stack.gateway_address, timeout=120, retries=0) as sdk:
        required = await sdk.chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
        named = await sdk.chat(ASK, tools=SDK_TOOLS, tool_choice="get_time", max_tokens=200, temperature=0)
    assert_valid_sdk_calls(required)
    assert_valid_sdk_calls(named)
    assert [c.name for c in named.tool_calls] == ["get_time"] and named.text == ""
    async with client(stack) as c:  # the same answer as over HTTP
        http = await c.chat.completions.create(model=stack.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                               max_tokens=200, temperature=0)
    assert [(t.function.name, t.function.arguments) for t in http.choices[0].message.tool_calls] == \
        [(c.name, c.arguments) for c in required.tool_calls]


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_sdk_auto_reads_a_call_and_a_resumed_stream_brings_the_same_calls(stack):
    """An auto answer with text before its call: the text streams as content, the call comes with
    the last chunk; resuming the finished request from each chunk's end gives the rest of the
    content and the same calls, ids included."""
    body = dict(messages=ASK, tools=SDK_TOOLS, max_tokens=80, temperature=0, structured_output={"regex": SHAPED})
    async with AsyncClient(stack.gateway_address, timeout=120, retries=0) as sdk:
        chunks = [chunk async for chunk in sdk.stream(request_id="tools-resume-1", **body)]
        assert chunks[-1].finish_reason == "tool_calls" and len(chunks) > 3
        assert "".join(c.text for c in chunks) == "Checking."
        assert_valid_sdk_calls(chunks[-1])
        assert all(not c.tool_calls for c in chunks[:-1])
        received = 0
        for j, chunk in enumerate(chunks[:-1]):
            received += len(chunk.token_ids)
            resumed = await sdk.chat(request_id="tools-resume-1", resume_from_index=received, **body)
            assert resumed.text == "".join(c.text for c in chunks[j + 1:])
            assert resumed.tool_calls == chunks[-1].tool_calls


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(tools=[{"name": "has space"}]), "tools[0].name"),
    (dict(tools=[{"name": "f", "parameters": "{not json"}]), "tools[0].parameters"),
    (dict(tools=SDK_TOOLS, tool_choice="nope"), "tool_choice_function"),
    (dict(tools=SDK_TOOLS, tool_choice="required", structured_output={"regex": "a+"}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
])
async def test_sdk_bad_tools_are_refused_by_name(stack, kwargs, field):
    async with AsyncClient(stack.gateway_address, timeout=60, retries=0) as sdk:
        with pytest.raises(InvalidArgumentError) as caught:
            await sdk.chat(ASK, max_tokens=4, **kwargs)
    assert caught.value.field == field


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_sdk_conversation_with_calls_and_results_is_answered(stack, hf_tokenizer):
    async with AsyncClient(stack.gateway_address, timeout=60, retries=0) as sdk:
        first = await sdk.chat(ASK, tools=SDK_TOOLS, tool_choice="get_weather", max_tokens=200, temperature=0)
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [c.message() for c in first.tool_calls]},
                   {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "Sunny, 24 C"}]
        reply = await sdk.chat(history, tools=SDK_TOOLS, tool_choice="none", max_tokens=8, temperature=0)
        over_http, = parse_chat({"messages": history, "tools": TOOLS, "tool_choice": "none"}).inputs
        sdk_ids = await sdk.tokenize(messages=history)
    assert reply.finish_reason == "length" and reply.tool_calls == ()
    # the turns render as over HTTP (tool_choice none: no tools described)
    assert sdk_ids == PromptTokenizer(hf_tokenizer).encode_chat(over_http.messages)

