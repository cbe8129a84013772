"""SchedulingConfig and SamplingParams: each bad value is rejected naming its field."""

from __future__ import annotations

import pytest

from scheduler_service.core import InvalidArgumentError, SamplingParams, SchedulingConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_batched_tokens", 0), ("max_num_batched_tokens", 1.5), ("max_num_seqs", 0),
        ("max_num_seqs", True), ("long_prefill_token_threshold", -1), ("enable_chunked_prefill", 1),
        ("enable_prefix_caching", "yes"), ("policy", "lifo"),
    ],
)
def test_scheduler_config_names_the_bad_field(field, value):
    with pytest.raises(InvalidArgumentError) as e:
        SchedulingConfig(**{field: value})
    assert e.value.field == field


def test_scheduler_config_defaults():
    c = SchedulingConfig()
    assert (c.max_num_batched_tokens, c.max_num_seqs, c.long_prefill_token_threshold) == (2048, 128, 0)
    assert c.enable_chunked_prefill and c.enable_prefix_caching and c.policy == "spf"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0), ("max_tokens", "8"), ("min_tokens", -1), ("temperature", -0.1),
        ("temperature", float("nan")), ("top_k", 0), ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5),
        ("min_p", 1.5), ("seed", -1), ("seed", 2**63), ("stop", [""]), ("stop", ["x"] * 17),
        ("stop_token_ids", [-1]), ("ignore_eos", 1), ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("logprobs", 21), ("logprobs", -1),
    ],
)
def test_sampling_params_names_the_bad_field(field, value):
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


def test_min_tokens_above_max_tokens_names_min_tokens():
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(max_tokens=2, min_tokens=3)
    assert e.value.field == "min_tokens"


def test_sampling_params_are_frozen_and_normalised():
    p = SamplingParams(stop=["a"], stop_token_ids=[3])
    assert p.stop == ("a",) and p.stop_token_ids == (3,)
    assert p.with_seed(5).seed == 5 and p.seed is None
    with pytest.raises(AttributeError):
        p.max_tokens = 3  # type: ignore[misc]


def test_the_seed_is_assigned_once_and_only_when_missing():
    import random

    unseeded = SamplingParams(temperature=0.7)
    seeded = unseeded.seeded(random.Random(1))

    assert seeded.seed is not None and seeded.temperature == 0.7
    assert seeded.seeded(random.Random(2)) is seeded  # a seed is never replaced
    assert unseeded.seeded(random.Random(1)).seed == seeded.seed  # a pure function of the rng


def test_trusted_params_skip_validation_but_keep_defaults():
    params = SamplingParams.trusted(max_tokens=5, stop=("x",))

    assert params == SamplingParams(max_tokens=5, stop=("x",))
    with pytest.raises(TypeError, match="bogus"):
        SamplingParams.trusted(bogus=1)


@pytest.mark.parametrize("field, value", [
    ("top_k", 10**20), ("top_k", 2**31), ("max_tokens", 2**31), ("min_tokens", 2**40), ("seed", 2**70),
    ("stop_token_ids", [2**31]), ("allowed_token_ids", [10**20]), ("logit_bias", {2**32: 1.0}),
])
def test_integers_past_what_the_wire_holds_are_refused_by_name(field, value):
    """The wire carries int32 counts and uint32 token ids (seeds int64): a larger value is an
    InvalidArgumentError naming its field, not an OverflowError in the worker's staging."""
    with pytest.raises(InvalidArgumentError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.field == field
    assert SamplingParams(top_k=2**31 - 1, stop_token_ids=[2**31 - 1]).top_k == 2**31 - 1


def test_greedy_is_a_temperature_below_the_sampling_eps():
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=1e-40).greedy
    assert not SamplingParams(temperature=1e-5).greedy and not SamplingParams(temperature=1.0).greedy


@pytest.mark.parametrize(("prompt", "words"), [
    ([1.7, 5], "token ids must be integers, got 1.7"),  # never truncated to 1
    ([True, 5], "token ids must be integers, got True"),
    (["a"], "token ids must be integers, got 'a'"),
    ([-1, 5], "token id -1 is out of vocabulary"),
    ([2**40], "token id 1099511627776 is out of vocabulary"),
    (b"hi", "must be text or a list of token ids, got bytes"),  # not the ids 104, 105
    ({"a": 1}, "must be text or a list of token ids, got dict"),
    (7, "must be text or a list of token ids, got int"),
])
def test_token_ids_from_a_caller_are_integers_or_refused_by_name(prompt, words):
    from pagedserve.wire import build_generate_request
    from servicekit.contract.prompt import token_id_list

    for refuse in (token_id_list, build_generate_request):  # the contract, then the SDK's request
        with pytest.raises(InvalidArgumentError, match="prompt") as info:
            refuse(prompt)
        assert words in str(info.value)


def test_token_id_lists_take_any_iterable_of_integers():
    import numpy as np

    from pagedserve.wire import build_generate_request
    from servicekit.contract.prompt import token_id_list

    assert token_id_list((1, 2)) == token_id_list(np.array([1, 2])) == token_id_list(range(1, 3)) == [1, 2]
    assert list(build_generate_request(np.array([3, 4])).prompt_token_ids.ids) == [3, 4]


def test_the_sdk_refuses_a_prompt_and_messages_together():
    from pagedserve.wire import build_generate_request, build_tokenize_request

    with pytest.raises(InvalidArgumentError, match="messages: give a prompt or messages"):
        build_generate_request("hi", messages=[{"role": "user", "content": "x"}])  # was: the prompt dropped
    with pytest.raises(InvalidArgumentError, match="messages: give text or messages"):
        build_tokenize_request("hi", messages=[{"role": "user", "content": "x"}])  # was: the text dropped


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": "hot"}, "temperature"), ({"max_tokens": 2.5}, "max_tokens"), ({"stop": 5}, "stop"),
    ({"seed": -5}, "seed"), ({"priority": 2**40}, "priority"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
])
def test_sdk_arguments_the_wire_cannot_carry_are_refused_by_name(kwargs, field):
    """Not protobuf's bare TypeError / ValueError ('must be real number, not str', 'Value out of range')."""
    from pagedserve.wire import build_generate_request

    with pytest.raises(InvalidArgumentError, match=f"^{field}: .* does not fit"):
        build_generate_request("hi", **kwargs)
    assert build_generate_request("hi", stop="x", seed=5, priority=-3).sampling_params.stop == ["x"]


def test_strings_that_are_not_unicode_text_are_refused_by_name():
    """A lone surrogate (what a JSON "\\ud800" escape leaves) cannot be encoded by the tokenizer or the
    wire: it was a bare UnicodeEncodeError from the SDK (a 500 over HTTP)."""
    from pagedserve.wire import build_generate_request
    from servicekit.contract.prompt import check_text

    check_text("prompt", "héllo 中文 😀")  # any real text passes
    lone = r"^prompt: must be Unicode text; a lone surrogate \('\\ud800' at 2\)"
    with pytest.raises(InvalidArgumentError, match=lone):
        build_generate_request("hi\ud800")
    with pytest.raises(InvalidArgumentError, match=r"^messages\[0\]\.content: must be Unicode text"):
        build_generate_request(messages=[{"role": "user", "content": "\udfff"}])
    with pytest.raises(InvalidArgumentError, match="^stop: "):
        build_generate_request("hi", stop=["\ud800"])
