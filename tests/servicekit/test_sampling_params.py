"""SamplingParams (``servicekit.contract.sampling_params``) and its wire form
(``servicekit.proto.sampling``): the round trip keeps defaults and values, allowed token ids are
checked, and a bad field on the wire raises naming it."""

from __future__ import annotations

from dataclasses import fields

import pytest

from pagedserve.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams
from servicekit.proto import sampling


def test_sampling_params_round_trip_keeps_defaults_and_values():
    every_field = SamplingParams(
        max_tokens=7, min_tokens=1, temperature=0.5, top_k=5, top_p=0.5, min_p=0.25, seed=2**63 - 1,
        stop=("a", "b"), stop_token_ids=(3,), ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5,
        frequency_penalty=-0.5, logprobs=2, prompt_logprobs=1, logit_bias={4: 2.5, 1: -1.0},
        allowed_token_ids=(9, 2, 9, 40))
    assert set(sampling.FIELDS) == {f.name for f in fields(SamplingParams)}  # the wire carries every field
    for params in (SamplingParams(), every_field):
        msg = sampling.sampling_params_to_pb(params)
        assert sampling.sampling_params_from_pb(msg) == params
        assert sampling.sampling_params_from_pb(msg, trusted=True) == params
        assert sampling.sampling_params_to_pb(sampling.sampling_params_from_pb(msg)) == msg
    assert sampling.sampling_params_to_bytes(every_field) == sampling.sampling_params_to_bytes(
        sampling.sampling_params_from_pb(sampling.sampling_params_to_pb(every_field)))


def test_allowed_token_ids_are_kept_sorted_unique_and_checked():
    from servicekit.contract.prompt import check_allowed_token_ids

    assert SamplingParams(allowed_token_ids=[9, 2, 9]).allowed_token_ids == (2, 9)
    # min_tokens bans stop ids and EOS: allowed ids all among them would leave nothing to sample
    with pytest.raises(InvalidArgumentError) as info:
        check_allowed_token_ids(SamplingParams(min_tokens=2, allowed_token_ids=[2, 7], stop_token_ids=[7]), (2,))
    assert info.value.field == "allowed_token_ids"
    check_allowed_token_ids(SamplingParams(min_tokens=2, allowed_token_ids=[2, 8], stop_token_ids=[7]), (2,))
    check_allowed_token_ids(SamplingParams(min_tokens=2, allowed_token_ids=[2], ignore_eos=True), (2,))
    check_allowed_token_ids(SamplingParams(allowed_token_ids=[2]), (2,))  # no min_tokens: EOS may end it
    for bad in ([-1], ["a"], 5):
        with pytest.raises(InvalidArgumentError) as info:
            SamplingParams(allowed_token_ids=bad)
        assert info.value.field == "allowed_token_ids"


def test_bad_sampling_field_on_the_wire_raises_naming_it():
    msg = sampling.sampling_params_to_pb(SamplingParams())
    msg.top_p = 2.0
    with pytest.raises(InvalidArgumentError) as info:
        sampling.sampling_params_from_pb(msg)
    assert info.value.field == "top_p"
