"""The SDK's protobuf layer: what a caller's arguments become on the wire, and which argument a
bad one is named by before anything is sent."""

from __future__ import annotations

import pytest

from gateway_service.convert import generate_input_from_pb
from pagedserve.wire import build_generate_request
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.structured_output import StructuredOutput


@pytest.mark.parametrize("bad", [-1, 2**40, 1.5])
def test_a_bad_token_id_is_named_prompt_token_ids_as_the_gateway_names_it(bad):
    with pytest.raises(InvalidArgumentError) as caught:
        build_generate_request([1, bad], max_tokens=2)
    assert caught.value.field == "prompt_token_ids"


def test_structured_output_travels_as_the_gateway_reads_it():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    for given, want in [({"json": schema}, StructuredOutput("json_schema", '{"type":"object","properties":'
                                                                         '{"b":{"type":"integer"},"a":{"type":"string"}}}')),
                        ({"choice": ["x", "y"]}, StructuredOutput("choice", ("x", "y"))),
                        (StructuredOutput("regex", "[a-z]+"), StructuredOutput("regex", "[a-z]+")),
                        ({"json_object": True}, StructuredOutput("json_object"))]:
        msg = build_generate_request("hi", max_tokens=4, structured_output=given)
        assert generate_input_from_pb(msg).sampling_params.structured_output == want
    with pytest.raises(InvalidArgumentError) as caught:
        build_generate_request("hi", structured_output={"regex": "a", "choice": ["b"]})
    assert caught.value.field == "structured_output"


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FLAT = [{"name": "get_weather", "description": "The forecast", "parameters": WEATHER}]
OPENAI = [{"type": "function", "function": FLAT[0]}]


@pytest.mark.parametrize("tools", [FLAT, OPENAI], ids=["flat", "openai"])
@pytest.mark.parametrize(("choice", "want"), [
    (None, ("auto", "")), ("required", ("required", "")), ("get_weather", ("function", "get_weather")),
    ({"type": "function", "function": {"name": "get_weather"}}, ("function", "get_weather")),
])
def test_tools_travel_as_the_gateway_reads_them(tools, choice, want):
    """The SDK's tools (flat or OpenAI's shape) and choices arrive as the gateway's ToolChoice; a
    required or named choice constrains the output to the calls' JSON."""
    msg = build_generate_request(messages=[{"role": "user", "content": "Weather?"}], tools=tools, tool_choice=choice,
                                 parallel_tool_calls=False)
    inp = generate_input_from_pb(msg)
    assert (inp.tools.choice, inp.tools.name) == want and inp.tools.parallel is False
    assert inp.tools.tools[0].parameters == WEATHER and inp.tools.tools[0].description == "The forecast"
    assert inp.messages[0]["role"] == "system" and "get_weather" in inp.messages[0]["content"]
    assert (inp.sampling_params.structured_output is not None) == (want[0] != "auto")


def test_a_history_with_calls_and_results_travels():
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Rain"}]
    inp = generate_input_from_pb(build_generate_request(messages=history, tools=FLAT, tool_choice="none"))
    assert inp.tools is None and [m["role"] for m in inp.messages] == ["user", "assistant", "user"]
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in inp.messages[1]["content"]
    assert inp.messages[2]["content"] == "<tool_response>\nRain\n</tool_response>"


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(prompt="text", tools=FLAT), "tools"),
    (dict(messages=[{"role": "user", "content": "x"}], tools=["get_weather"]), "tools[0]"),
    (dict(messages=[{"role": "user", "content": "x"}], tools=FLAT, tool_choice=3), "tool_choice"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]), "messages[0].tool_calls[0]"),
])
def test_bad_tool_arguments_are_refused_in_the_sdk_by_name(kwargs, field):
    with pytest.raises(InvalidArgumentError) as caught:
        build_generate_request(**kwargs)
    assert caught.value.field == field


def test_the_end_user_travels_to_the_gateway_and_a_long_one_is_refused_by_name():
    # The tenant of the request's fair share when the gateway takes tenants from it (no API keys).
    assert generate_input_from_pb(build_generate_request("hi", max_tokens=2, user="team-a")).user == "team-a"
    assert generate_input_from_pb(build_generate_request("hi", max_tokens=2)).user == ""
    assert generate_input_from_pb(build_generate_request("hi", max_tokens=2, user="u" * 256)).user == "u" * 256
    with pytest.raises(InvalidArgumentError) as caught:
        generate_input_from_pb(build_generate_request("hi", max_tokens=2, user="u" * 257))
    assert caught.value.field == "user" and "at most 256 characters" in str(caught.value)
