"""The services' pure pieces: detokenizer, stop strings, wire conversions, settings, error mapping."""

from __future__ import annotations

import grpc
import pytest

from gateway_service.text import IncrementalDetokenizer, StopStringMatcher
from pagedserve.errors import InvalidArgumentError, from_rpc_error
from scheduler_service import convert as scheduler_convert
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from servicekit.proto import convert as shared_convert
from worker_service import convert as worker_convert


def test_detokenizer_never_emits_a_broken_character_and_joins_to_decode(hf_tokenizer):
    text = "naïve café — 東京タワー 🚀 done"
    ids = hf_tokenizer.encode(text)
    prompt = hf_tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(hf_tokenizer, prompt)
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert any(p == "" for p in pieces)  # a multi-byte character spans tokens and was held back


def test_the_backend_decode_gives_what_the_tokenizers_decode_gives(hf_tokenizer):
    import random

    from gateway_service.text import backend_decode

    fast = backend_decode(hf_tokenizer)
    assert fast is not None  # SmolLM2's tokenizer is a fast one without space clean-up
    rng = random.Random(0)
    specials = list(hf_tokenizer.all_special_ids)
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(hf_tokenizer))
               for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)

    class Slow:  # a tokenizer that cleans up spaces (or has no backend) keeps its own decode
        clean_up_tokenization_spaces = True
        backend_tokenizer = hf_tokenizer.backend_tokenizer
    assert backend_decode(Slow()) is None and backend_decode(object()) is None


def test_stop_matcher_holds_back_possible_stop_prefixes():
    m = StopStringMatcher(("STOP", "\n\n"))
    assert m.feed("hello S") == ("hello ", None)
    assert m.feed("T") == ("", None)
    assert m.feed("x") == ("STx", None)  # not a stop after all: released
    assert m.feed(" end\n") == (" end", None)
    assert m.feed("\nmore") == ("", "\n\n")


def test_stop_matcher_finds_the_earliest_stop_and_drops_the_rest():
    m = StopStringMatcher(("world", "lo"))
    assert m.feed("hello world") == ("hel", "lo")


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


def test_step_diff_round_trips_between_scheduler_and_worker():
    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3], [4], SamplingParams(seed=5, max_tokens=9), [1, 2], 0)],
        scheduled_cached_reqs=[CachedRequestData("b", [7], 30)],
        num_scheduled_tokens={"a": 4, "b": 1}, total_num_scheduled_tokens=5,
        finished_req_ids={"c"}, preempted_req_ids={"d"})
    assert worker_convert.scheduler_output_from_pb(scheduler_convert.scheduler_output_to_pb(so, 1)) == so

    out = ModelRunnerOutput(sampled_token_ids={"a": [11], "b": [12]},
                            logprobs={"a": [TokenLogprobs(11, -0.5, [(11, -0.5), (3, -1.5)])]})
    back = scheduler_convert.runner_output_from_pb(worker_convert.runner_output_to_pb(1, out, 0.01))
    assert back.sampled_token_ids == out.sampled_token_ids
    assert back.logprobs["a"][0].token_id == 11 and back.logprobs["a"][0].top[1][0] == 3


def test_invalid_argument_survives_the_wire_with_its_field():
    class FakeRpcError(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return "temperature: must be >= 0.0, got -1"

        def trailing_metadata(self):
            return (("pagedserve-field", "temperature"),)

    err = from_rpc_error(FakeRpcError())
    assert isinstance(err, InvalidArgumentError)
    assert err.field == "temperature" and err.message == "must be >= 0.0, got -1"


def test_settings_come_from_flags_over_env_over_defaults():
    from gateway_service.main import build_parser, settings_from_args

    env = {"PAGEDSERVE_PORT": "6000", "PAGEDSERVE_MAX_QUEUED_REQUESTS": "7", "PAGEDSERVE_KEY_PREFIX": "x:"}
    settings = settings_from_args(build_parser(env).parse_args(["--port", "6001"]))
    assert (settings.port, settings.max_queued_requests, settings.key_prefix) == (6001, 7, "x:")
    assert settings.redis_url == "redis://127.0.0.1:6379/0"


def test_scheduler_settings_parse_worker_lists_and_booleans():
    from scheduler_service.main import build_parser, settings_from_args

    env = {"PAGEDSERVE_ENABLE_PREFIX_CACHING": "false"}
    settings = settings_from_args(build_parser(env).parse_args(["--workers", "a:1, b:2"]))
    assert settings.workers == ("a:1", "b:2") and settings.enable_prefix_caching is False


def test_client_commands_default_to_the_stack_pagedserve_serve_starts():
    from pagedserve.cli import build_parser

    parser = build_parser({})
    assert parser.parse_args(["stats"]).address == "127.0.0.1:50052"  # the scheduler's admin port
    assert parser.parse_args(["stats", "sched:6000"]).address == "sched:6000"
    assert parser.parse_args(["generate", "hi"]).address == "127.0.0.1:50051"  # the gateway
