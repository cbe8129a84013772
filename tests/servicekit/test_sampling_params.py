"""SamplingParams (``servicekit.contract.sampling_params``) and its wire form
(``servicekit.proto.convert``): the round trip keeps defaults and values, allowed token ids are
checked, and a bad field on the wire raises naming it."""

from __future__ import annotations

import pytest

from pagedserve.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams
from servicekit.proto import convert as shared_convert


def test_sampling_params_round_trip_keeps_defaults_and_values():
    for params in (SamplingParams(), SamplingParams(max_tokens=7, temperature=0.0, top_k=5, top_p=0.5, min_p=0.1,
                                                    seed=2**63 - 1, stop=("a", "b"), stop_token_ids=(3,),
                                                    ignore_eos=True, logprobs=2, min_tokens=1,
                                                    allowed_token_ids=(9, 2, 9, 40))):
        assert shared_convert.sampling_params_from_pb(shared_convert.sampling_params_to_pb(params)) == params


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
    msg = shared_convert.sampling_params_to_pb(SamplingParams())
    msg.top_p = 2.0
    with pytest.raises(InvalidArgumentError) as info:
        shared_convert.sampling_params_from_pb(msg)
    assert info.value.field == "top_p"
