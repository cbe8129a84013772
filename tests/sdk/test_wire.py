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
