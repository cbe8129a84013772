"""OpenAI's Responses API: bodies read into the chat path's request (pure), a response's events
made alike by a first producer and by one that takes it over (pure), and the whole path against
the in-process stack with the official ``openai`` client — whole and streamed, a conversation
continued through another gateway, a background response followed after the gateway that made it
was killed or drained, a client that left, cancel, delete, another key's 404, a function-call
turn, structured output, refusals, and one tool-using turn of an OpenAI Agents SDK agent.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest

from gateway_service.messages import GenerateChunk
from gateway_service.response_events import ResponseBuilder, ResponseState, response_head
from gateway_service.responses_params import as_sent, chat_body, parse_response
from gateway_service.tool_calls import ToolCall
from servicekit.contract.api import Usage
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.step import FinishReason

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOL = {"type": "function", "name": "get_weather", "description": "The forecast", "parameters": WEATHER}
RID = "resp_" + "0" * 32


def parsed(**body):
    return parse_response(body, RID)


# -- pure: bodies -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "field"), [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "prompt_cache_key": "k"}, "prompt_cache_key"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "hi", "previous_response_id": "chatcmpl-1"}, "previous_response_id"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata.k"),
    ({"input": "hi", "user": "u" * 257}, "user"),
])
def test_unsupported_or_bad_fields_are_refused_by_name(body, field):
    with pytest.raises(InvalidArgumentError) as caught:
        parsed(**body)
    assert caught.value.field == field


def test_items_become_chat_turns_and_chat_errors_name_the_items():
    from gateway_service.openai_params import parse_chat

    req = parsed(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Answer in one line."}]}],
        tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=9,
        text={"format": {"type": "text"}})
    chat, sources = chat_body(req, [])
    assert [t["role"] for t in chat["messages"]] == ["system", "user", "assistant", "tool", "developer"]
    assert chat["messages"][2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sources == ["instructions", "input[0]", "input[1]", "input[2]", "input[3]"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_completion_tokens"] == 9 and parse_chat(chat).tools.name == "get_weather"
    assert all(item["id"] for item in req.input_items)

    bad = parsed(input=[{"role": "user", "content": "a"}, {"role": "user", "content": "\ud800"}])
    chat, sources = chat_body(bad, [])
    with pytest.raises(InvalidArgumentError) as caught:
        parse_chat(chat)
    assert as_sent(caught.value, sources).field == "input[1].content"
    schema = parsed(input="x", text={"format": {"type": "json_schema", "name": "n", "schema": "not json"}})
    with pytest.raises(InvalidArgumentError) as caught:
        parse_chat(chat_body(schema, [])[0])
    assert as_sent(caught.value, []).field == "text.format.schema"
    named = parsed(input="x", tools=[TOOL], tool_choice={"type": "function", "name": "nope"})
    with pytest.raises(InvalidArgumentError) as caught:
        parse_chat(chat_body(named, [])[0])
    assert as_sent(caught.value, []).field == "tool_choice.name"


# -- pure: events -----------------------------------------------------------------------------------

def _chunks(text: str, cuts: list[int], *, calls=(), finish=FinishReason.STOP) -> list[GenerateChunk]:
    bounds = [0, *cuts, len(text)]
    out = [GenerateChunk("r", text=text[a:b]) for a, b in zip(bounds, bounds[1:])]
    out[-1].finish_reason, out[-1].usage, out[-1].tool_calls = finish, Usage(5, 7, 0), list(calls)
    return out


def _run(builder: ResponseBuilder, chunks: list[GenerateChunk]) -> list[dict]:
    events = builder.start()
    for chunk in chunks:
        events += builder.take(chunk)
    return events


@pytest.mark.parametrize("calls", [(), (ToolCall("call_x", "get_weather", '{"city": "Oslo", "days": 2}'),)])
def test_a_takeover_continues_the_log_with_its_own_chunks(calls):
    """A producer that takes over replays the log and reads the generation again, cut into other
    chunks: the log it continues is a first producer's, event for event in kind and text."""
    req = parsed(input="hi", background=True)
    head = response_head(req, model="m", temperature=0.0, top_p=1.0)
    text = "Hello there, how are you doing today?"
    whole = _run(ResponseBuilder(ResponseState(head)), _chunks(text, [3, 9, 20, 30], calls=calls))
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta") == text
    final = ResponseState.replay(head, whole).object()
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 12
    assert final["output"][0]["content"][0]["text"] == text
    assert [item["type"] for item in final["output"]] == ["message"] + ["function_call"] * len(calls)
    chunks = _chunks(text, [3, 9, 20, 30], calls=calls)
    finish_at = len(_run(ResponseBuilder(ResponseState(head)), chunks[:-1]))  # the last batch is written at once
    for cut in range(2, finish_at + 1):  # the first producer died after event cut - 1
        state = ResponseState.replay(head, whole[:cut])
        log = whole[:cut] + _run(ResponseBuilder(state), _chunks(text, [25], calls=calls))  # other chunks
        assert [e["sequence_number"] for e in log] == list(range(len(log)))
        assert "".join(e["delta"] for e in log if e["type"] == "response.output_text.delta") == text
        replayed = ResponseState.replay(head, log).object()
        assert replayed["output"] == final["output"] and replayed["status"] == "completed"


def test_a_cut_off_answer_is_incomplete():
    req = parsed(input="hi", max_output_tokens=7)
    head = response_head(req, model="m", temperature=0.0, top_p=1.0)
    events = _run(ResponseBuilder(ResponseState(head)), _chunks("abc", [1], finish=FinishReason.LENGTH))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"


# -- the stack --------------------------------------------------------------------------------------

def stack_test(test):
    """A test against the session's in-process stack, on its event loop."""
    return pytest.mark.service(pytest.mark.asyncio(loop_scope="session")(test))


GREEDY = dict(temperature=0)


def client_of(url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


async def _gateway(stack, hf_tokenizer, **settings):
    from gateway_service.config import GatewayConfig
    from gateway_service.main import GatewayApp

    gateway = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=0, redis_url=stack.redis_url,
                                       read_block_ms=200, **settings), hf_tokenizer=hf_tokenizer)
    await gateway.start()
    return gateway


def url_of(gateway) -> str:
    return f"http://127.0.0.1:{gateway.http_port}/v1"


async def collect(stream) -> list:
    return [event async for event in stream]


def deltas(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


@stack_test
async def test_whole_and_streamed_responses_agree(stack):
    async with client_of(stack.http_url) as client:
        whole = await client.responses.create(model=stack.model, input="Tell me a story", max_output_tokens=24,
                                              **GREEDY)
        events = await collect(await client.responses.create(model=stack.model, input="Tell me a story",
                                                             max_output_tokens=24, stream=True, **GREEDY))
        again = await client.responses.retrieve(whole.id)
        unstored = await client.responses.create(model=stack.model, input="Tell me a story", max_output_tokens=24,
                                                 store=False, **GREEDY)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == stack.model
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.output_tokens <= 24 and whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert deltas(events) == whole.output_text == events[-1].response.output_text
    assert again.output_text == whole.output_text == unstored.output_text and again.status == whole.status


@stack_test
async def test_a_conversation_continues_through_another_gateway(stack, hf_tokenizer):
    """previous_response_id, read from Redis by a gateway that did not make the first response: the
    follow-up sees the same conversation as a chat of the same turns (same prompt, same greedy text)."""
    second = await _gateway(stack, hf_tokenizer)
    try:
        async with client_of(stack.http_url) as one, client_of(url_of(second)) as two:
            first = await one.responses.create(model=stack.model, instructions="Be brief.", input="Name a colour",
                                               max_output_tokens=8, **GREEDY)
            follow = await two.responses.create(model=stack.model, previous_response_id=first.id,
                                                input=[{"role": "user", "content": "And another?"}],
                                                max_output_tokens=8, **GREEDY)
            chat = await two.chat.completions.create(model=stack.model, max_tokens=8, temperature=0, messages=[
                {"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And another?"}])
            items = await one.responses.input_items.list(follow.id)
    finally:
        await second.drain(1)
    assert follow.previous_response_id == first.id
    assert follow.output_text == chat.choices[0].message.content  # instructions are not carried over
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert [item.content[0].text for item in items.data] == ["And another?"]


@stack_test
async def test_input_items_are_listed_as_openai_lists_them(stack):
    inputs = [{"role": "user", "content": f"turn {i}"} for i in range(5)]
    async with client_of(stack.http_url) as client:
        made = await client.responses.create(model=stack.model, input=inputs, max_output_tokens=2, **GREEDY)
        desc = await client.responses.input_items.list(made.id)
        asc = await client.responses.input_items.list(made.id, order="asc", limit=2)
        rest = await client.responses.input_items.list(made.id, order="asc", after=asc.last_id)
    texts = lambda page: [item.content[0].text for item in page.data]  # noqa: E731
    assert texts(desc) == [f"turn {i}" for i in reversed(range(5))] and not desc.has_more
    assert texts(asc) == ["turn 0", "turn 1"] and asc.has_more and asc.first_id == asc.data[0].id
    assert texts(rest) == ["turn 2", "turn 3", "turn 4"]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status
    except Exception:  # noqa: BLE001 - not up yet
        return 0


@pytest.fixture
def gateway_process(stack, tmp_path):
    """A gateway of its own process on the stack's Redis, to be killed with SIGKILL."""
    from pagedserve.launcher import free_port

    port = free_port()
    log = open(tmp_path / "gateway.log", "wb")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "pagedserve"), "gateway", "--model", stack.model,
                             "--port", "0", "--http-port", str(port), "--redis-url", stack.redis_url,
                             "--read-block-ms", "200"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while _get(f"http://127.0.0.1:{port}/health") != 200:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "gateway.log").read_text()
        time.sleep(0.2)
    yield proc, f"http://127.0.0.1:{port}/v1"
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    log.close()


PROMPT = "Write a long story about the sea"


@stack_test
async def test_a_background_response_outlives_the_gateway_that_made_it(stack, gateway_process):
    """A background response made on a gateway killed with SIGKILL while it streams: its stream
    resumed elsewhere with starting_after gives every event once, in order (the stored log), and the
    same text as an uninterrupted response; the response finishes and is retrieved elsewhere."""
    proc, url = gateway_process
    async with client_of(url) as doomed, client_of(stack.http_url) as other:
        made = await doomed.responses.create(model=stack.model, input=PROMPT, max_output_tokens=300,
                                             background=True, **GREEDY)
        assert made.status == "queued" and made.background
        seen = []
        async for event in await doomed.responses.retrieve(made.id, stream=True):
            seen.append(event)
            if len(seen) == 6:
                break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        after = seen[-1].sequence_number
        seen += await collect(await other.responses.retrieve(made.id, stream=True, starting_after=after))
        done = await other.responses.retrieve(made.id)
        replay = await collect(await other.responses.retrieve(made.id, stream=True))
        past_the_end = await collect(await other.responses.retrieve(made.id, stream=True,
                                                                    starting_after=replay[-1].sequence_number))
        uninterrupted = await other.responses.create(model=stack.model, input=PROMPT, max_output_tokens=300, **GREEDY)
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert [e.model_dump() for e in seen] == [e.model_dump() for e in replay] and past_the_end == []
    assert done.status == uninterrupted.status and done.status in ("completed", "incomplete")
    assert deltas(seen) == done.output_text == uninterrupted.output_text
    assert done.usage.output_tokens == uninterrupted.usage.output_tokens


@stack_test
async def test_a_background_response_is_handed_over_by_a_draining_gateway(stack, hf_tokenizer):
    """A gateway that drains past its grace gives its background responses up: the next reader, on
    another gateway, takes the production over at once and the log goes on without a gap."""
    leaving = await _gateway(stack, hf_tokenizer)
    try:
        async with client_of(url_of(leaving)) as one:
            made = await one.responses.create(model=stack.model, input=PROMPT, max_output_tokens=300,
                                              background=True, **GREEDY)
            stream = await one.responses.retrieve(made.id, stream=True)
            seen = [await stream.__anext__() for _ in range(5)]
            await stream.close()
    finally:
        await leaving.drain(0.2)
    async with client_of(stack.http_url) as two:
        seen += await collect(await two.responses.retrieve(made.id, stream=True,
                                                           starting_after=seen[-1].sequence_number))
        done = await two.responses.retrieve(made.id)
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert deltas(seen) == done.output_text and done.status in ("completed", "incomplete")


@stack_test
async def test_a_streamed_response_whose_client_left_is_cancelled(stack):
    """Not in the background, a response lives as long as its call: its client gone, the generation
    is aborted (its KV blocks freed) and the stored response ends cancelled."""
    from helpers.stack import wait_until_kv_free

    async with client_of(stack.http_url) as client:
        stream = await client.responses.create(model=stack.model, input=PROMPT, max_output_tokens=400, stream=True,
                                               **GREEDY)
        first = [await stream.__anext__() for _ in range(4)]
        await stream.close()
        for _ in range(100):
            left = await client.responses.retrieve(first[0].response.id)
            if left.status != "in_progress":
                break
            await asyncio.sleep(0.05)
    assert left.status == "cancelled" and len(left.output[0].content[0].text) > 0
    await wait_until_kv_free(stack.scheduler_address)


@stack_test
async def test_cancel_ends_a_background_response_and_delete_forgets_it(stack):
    async with client_of(stack.http_url) as client:
        made = await client.responses.create(model=stack.model, input=PROMPT, max_output_tokens=400, background=True,
                                             **GREEDY)
        stream = await client.responses.retrieve(made.id, stream=True)
        first = [await stream.__anext__() for _ in range(4)]  # generating
        cancelled = await client.responses.cancel(made.id)
        rest = await collect(stream)
        again = await client.responses.cancel(made.id)  # idempotent
        with pytest.raises(openai.BadRequestError) as not_background:
            await client.responses.cancel((await client.responses.create(
                model=stack.model, input="hi", max_output_tokens=2)).id)
        await client.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(made.id)
    assert cancelled.status == again.status == "cancelled"
    assert (first + rest)[-1].type == "response.cancelled"
    assert cancelled.usage is None or cancelled.usage.output_tokens < 400
    assert not_background.value.body["param"] == "response_id"


@stack_test
async def test_another_key_gets_404_for_every_route(stack, hf_tokenizer):
    keyed = await _gateway(stack, hf_tokenizer, api_keys=("key-alice", "key-bob"))
    try:
        async with client_of(url_of(keyed), "key-alice") as alice, client_of(url_of(keyed), "key-bob") as bob:
            made = await alice.responses.create(model=stack.model, input="Mine", max_output_tokens=2, **GREEDY)
            assert (await alice.responses.retrieve(made.id)).id == made.id
            calls = [bob.responses.retrieve(made.id), bob.responses.input_items.list(made.id),
                     bob.responses.cancel(made.id), bob.responses.delete(made.id),
                     bob.responses.create(model=stack.model, input="x", previous_response_id=made.id)]
            for call in calls:
                with pytest.raises(openai.NotFoundError):
                    await call
            assert (await alice.responses.retrieve(made.id)).status == made.status  # still there
    finally:
        await keyed.drain(1)


@stack_test
async def test_a_function_call_turn_and_its_result(stack):
    async with client_of(stack.http_url) as client:
        called = await client.responses.create(model=stack.model, input="What is the weather in Paris for 3 days?",
                                               tools=[TOOL], tool_choice="required", max_output_tokens=120, **GREEDY)
        calls = [item for item in called.output if item.type == "function_call"]
        assert calls and called.status == "completed"
        for call in calls:
            assert call.name == "get_weather" and call.call_id.startswith("call_")
            jsonschema.validate(json.loads(call.arguments), WEATHER)
        streamed = await collect(await client.responses.create(
            model=stack.model, input="What is the weather in Paris for 3 days?", tools=[TOOL],
            tool_choice="required", max_output_tokens=120, stream=True, **GREEDY))
        answered = await client.responses.create(
            model=stack.model, previous_response_id=called.id, tools=[TOOL], max_output_tokens=12,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}
                   for call in calls], **GREEDY)
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments for call in calls]
    assert answered.status in ("completed", "incomplete") and answered.previous_response_id == called.id


@stack_test
async def test_json_schema_output_parses_and_validates(stack):
    async with client_of(stack.http_url) as client:
        made = await client.responses.create(
            model=stack.model, input="The weather, as JSON", max_output_tokens=120, **GREEDY,
            text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
        with pytest.raises(openai.BadRequestError) as bad_schema:
            await client.responses.create(model=stack.model, input="x", text={"format": {
                "type": "json_schema", "name": "w", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}})
    assert made.status == "completed" and made.text.format.type == "json_schema"
    jsonschema.validate(json.loads(made.output_text), WEATHER)
    assert bad_schema.value.body["param"] == "text.format.schema"


@stack_test
async def test_unsupported_fields_are_400s_naming_them(stack):
    async with client_of(stack.http_url) as client:
        for kwargs, param in [(dict(tools=[{"type": "web_search_preview"}]), "tools[0].type"),
                              (dict(reasoning={"effort": "high"}), "reasoning"),
                              (dict(extra_body={"prompt_cache_key": "k"}), "prompt_cache_key"),
                              (dict(background=True, store=False), "background")]:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(model=stack.model, input="hi", **kwargs)
            assert caught.value.body["param"] == param and caught.value.body["type"] == "BadRequestError"
        for store in (True, False):  # refused at admission: an HTTP error, and nothing stored
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(model=stack.model, input="hi", max_output_tokens=100_000, store=store)
            assert caught.value.body["param"] == "max_output_tokens", caught.value.body
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_" + "f" * 32)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="another-model", input="hi")


@stack_test
async def test_an_agent_runs_a_tool_using_turn_against_the_server(stack):
    """The OpenAI Agents SDK's Responses model against the gateway: the required tool choice makes
    the agent call its function tool, whose result goes back as a function_call_output item; the
    next turn (tool choice reset to auto) answers in the agent's output type (text.format)."""
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: Literal["Paris", "Rome"]
        sunny: bool

    agents.set_tracing_disabled(True)
    asked = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The forecast for a city."""
        asked.append(city)
        return f"Sunny in {city}"

    async with client_of(stack.http_url) as client:
        agent = agents.Agent(name="forecaster", instructions="Answer with the forecast.", tools=[get_weather],
                             output_type=Forecast, model=OpenAIResponsesModel(model=stack.model, openai_client=client),
                             model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                 max_tokens=120))
        result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"] and len(asked) == 1
    assert result.new_items[1].output == f"Sunny in {asked[0]}"
    assert isinstance(result.final_output, Forecast)
