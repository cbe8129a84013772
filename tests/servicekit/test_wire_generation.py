"""The public API's shared conversions (``servicekit.proto.generation``): what the SDK builds the
gateway reads back as it was (a chat's turns), and what the gateway answers the SDK reads back
(Usage, ModelInfo), both ways, with a non-default value in every field."""

from __future__ import annotations

import pytest

from servicekit.contract.api import ModelInfo, Usage
from servicekit.contract.errors import InvalidArgumentError
from servicekit.proto import generation
from servicekit.proto.pb import generation_pb2


def test_a_chat_round_trips():
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    msg = generation_pb2.GenerateRequest()
    generation.chat_to_pb(turns, msg.chat)
    assert generation.chat_from_pb(msg.chat) == turns
    again = generation_pb2.GenerateRequest()
    generation.chat_to_pb(generation.chat_from_pb(msg.chat), again.chat)
    assert again == msg


def test_an_empty_chat_is_a_chat_and_too_many_turns_are_refused_naming_messages():
    msg = generation_pb2.GenerateRequest()
    generation.chat_to_pb([], msg.chat)
    assert msg.WhichOneof("input") == "chat"
    generation.chat_to_pb([{"role": "user", "content": "x"}] * (generation.MAX_CHAT_MESSAGES + 1), msg.chat)
    with pytest.raises(InvalidArgumentError) as info:
        generation.chat_from_pb(msg.chat)
    assert info.value.field == "messages"
    with pytest.raises(InvalidArgumentError) as info:
        generation.chat_to_pb(["not a mapping"], generation_pb2.Chat())
    assert info.value.field == "messages[0]"


def test_usage_and_model_info_round_trip():
    usage = Usage(prompt_tokens=11, completion_tokens=7, cached_prompt_tokens=3)
    msg = generation_pb2.GenerateResponse()
    generation.usage_to_pb(usage, msg.usage)
    assert generation.usage_from_pb(msg.usage) == usage
    info = ModelInfo(model="m", max_model_len=2048, vocab_size=512, eos_token_ids=(2, 7), num_workers=3, block_size=16)
    reply = generation.model_info_to_pb(info)
    assert generation.model_info_from_pb(reply) == info
    assert generation.model_info_to_pb(generation.model_info_from_pb(reply)) == reply
