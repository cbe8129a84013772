"""Structured output through the gateway: OpenAI's ``response_format``, vLLM's ``structured_outputs``
and ``guided_*`` keys over HTTP (the official ``openai`` client), the SDK's ``structured_output``
over gRPC, each equal to the in-process engine's tokens; bad constraints refused by name before
anything is queued."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from pagedserve.aio_client import AsyncClient
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]

# Bounded everywhere (lengths, patterns, enums, item counts) so the suite's random tiny model ends
# each within max_tokens: it is the grammar, not the model, that makes these outputs valid.
ITEM = {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                         "ok": {"type": "boolean"}}, "required": ["sku", "ok"]}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"]},
    "enum-and-array": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
        "required": ["color", "tags"]},
    "nested-with-ref": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "items": {"type": "array", "minItems": 2, "maxItems": 3, "items": {"$ref": "#/$defs/item"}},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}},
        "required": ["id", "items", "owner"], "$defs": {"item": ITEM}},
    "any-of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                    {"type": "boolean"}]}},
               "required": ["value"]},
}
MAX_TOKENS = 200


def client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("name", list(SCHEMAS))
async def test_chat_response_format_json_schema_validates_and_equals_the_engine(stack, llm, name):
    schema = SCHEMAS[name]
    messages = [{"role": "user", "content": f"Give me a {name} record."}]
    async with client(stack) as c:
        reply = await c.chat.completions.create(
            model=stack.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}})
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert reply.choices[0].finish_reason == "stop"

    expected = llm.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                 structured_output={"json": schema}))[0]
    assert text == expected.text


async def test_json_object_regex_choice_and_grammar_over_http(stack):
    async with client(stack) as c:
        obj = await c.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "JSON please"}],
                                              max_tokens=MAX_TOKENS, temperature=0.7, seed=3,
                                              response_format={"type": "json_object"})
        regex = await c.completions.create(model=stack.model, prompt="A code:", max_tokens=30, temperature=0.9,
                                           seed=1, extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}})
        choice = await c.completions.create(model=stack.model, prompt="Pick:", max_tokens=10, temperature=1.0, seed=2,
                                            extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]})
        grammar = await c.completions.create(
            model=stack.model, prompt="Sum:", max_tokens=30, temperature=0.8, seed=4,
            extra_body={"guided_grammar": 'root ::= num " + " num\nnum ::= [1-9] [0-9]?'})
    content = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":  # a free object may run past max_tokens; its prefix is still JSON-shaped
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    assert choice.choices[0].text in ("alpha", "beta", "gamma delta")
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", grammar.choices[0].text)


async def test_streamed_constrained_output_equals_the_whole_one(stack):
    body = dict(model=stack.model, prompt="Colors:", max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"guided_json": SCHEMAS["enum-and-array"]})
    async with client(stack) as c:
        whole = await c.completions.create(**body)
        parts = [chunk.choices[0].text async for chunk in await c.completions.create(stream=True, **body)
                 if chunk.choices]
    assert "".join(parts) == whole.choices[0].text
    jsonschema.validate(json.loads(whole.choices[0].text), SCHEMAS["enum-and-array"])


async def test_grpc_structured_output_equals_the_engine(stack, llm):
    constraint = {"regex": r"(yes|no), because [a-z]{3,8}\."}
    expected = llm.generate(["Well?"], SamplingParams(max_tokens=40, temperature=0.8, seed=11,
                                                      structured_output=constraint))[0]
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        got = await sdk.generate("Well?", max_tokens=40, temperature=0.8, seed=11, structured_output=constraint)
    assert list(got.token_ids) == expected.token_ids and re.fullmatch(constraint["regex"], got.text)


@pytest.mark.parametrize(("extra", "field", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema", "invalid json schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "must be text"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "invalid grammar"),
    ({"guided_choice": []}, "guided_choice", "1 to"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs", "one constraint"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not a supported"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "one output constraint"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos", "cannot be combined"),
    ({"guided_json": {"type": "object", "properties": {"x": {"type": "string", "description": "y" * 70000}}}},
     "guided_json", "at most 65536"),
])
async def test_bad_constraints_are_refused_by_name(stack, extra, field, says):
    async with client(stack) as c:
        with pytest.raises(openai.BadRequestError) as caught:
            await c.completions.create(model=stack.model, prompt="x", max_tokens=5, extra_body=extra)
    error = caught.value.body
    assert error["param"] == field, error
    assert says in error["message"], error


async def test_grpc_refuses_a_bad_constraint_by_name(stack):
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        with pytest.raises(InvalidArgumentError) as caught:
            await sdk.generate("x", max_tokens=5, structured_output={"json": '{"type": "bogus"}'})
    assert caught.value.field == "structured_output" and "invalid json schema" in caught.value.message


@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_a_grammar_that_cannot_end_in_max_tokens_ends_with_length_and_says_so(stack, caplog):
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        with caplog.at_level("WARNING", logger="gateway_service.generation"):
            cut = await sdk.generate("Say a lot", max_tokens=5, structured_output={"regex": "(ab){40}"},
                                     request_id="grammar-too-long-1")
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5 and re.fullmatch(r"(ab)*a?", cut.text)
    assert any("grammar-too-long-1" in r.getMessage() and "could not end within max_tokens" in r.getMessage()
               for r in caplog.records)
