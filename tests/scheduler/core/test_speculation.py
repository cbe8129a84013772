"""Draft tokens (n-gram speculation) in the scheduler core: the worker proposes them with a step's
answer, the scheduler schedules them in the request's next step and takes back the positions of
those the worker did not keep.

The FakeWorker proposes and verifies drafts as a real worker does and checks the KV of every
position it reads, so a rejected draft's position counted as computed, or a block table too short
for the drafts, shows up.
"""

from __future__ import annotations

import zlib

import pytest

from scheduler_service.core import ModelRunnerOutput, SamplingParams

from .helpers import FakeWorker, make_request, make_scheduler, step
from .test_simulation import simulate


def looping_model(request_id: str, index: int) -> int:
    """A model that repeats a short cycle (as a small model decoding greedily often does), with a
    token off the cycle now and then: drafts are mostly right, sometimes wrong."""
    h = zlib.crc32(f"{request_id}/{index}".encode())
    if h % 11 == 0:
        return 10 + h % 40
    period = 3 + zlib.crc32(request_id.encode()) % 4
    return 20 + index % period


def test_every_token_is_what_one_token_steps_give_with_fewer_steps():
    runs = {}
    for k in (0, 3):
        steps: list = []
        simulate(200, seed=3, model=looping_model, steps=steps, num_drafts=k, num_blocks=81, block_size=4,
                 max_model_len=128, max_num_batched_tokens=64, max_num_seqs=24)
        runs[k] = steps
    drafted = [out for out in runs[3] if out.scheduled_spec_decode_tokens]
    assert not any(out.scheduled_spec_decode_tokens for out in runs[0])
    assert drafted, "the looping model's requests never got drafts"
    for out in drafted:
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        for rid, drafts in out.scheduled_spec_decode_tokens.items():
            assert 1 <= len(drafts) <= 3 and out.num_scheduled_tokens[rid] == 1 + len(drafts)
    assert len(runs[3]) < 0.85 * len(runs[0])  # simulate() checked every token of both runs


@pytest.mark.parametrize("config", [dict(), dict(policy="priority", long_prefill_token_threshold=16),
                                    dict(policy="fair", tenants=4)])
def test_drafts_under_preemption_lose_and_change_nothing(config):
    simulate(400, seed=11, model=looping_model, num_drafts=4, num_blocks=41, block_size=4, max_model_len=128,
             max_num_batched_tokens=48, max_num_seqs=24, **config)


def run_alone(request, num_drafts: int, **config) -> list:
    """``request`` alone through a FakeWorker proposing ``num_drafts``; returns (outputs before, plan) per step."""
    s = make_scheduler(**config)
    worker = FakeWorker(s.worker.num_blocks, s.worker.block_size, looping_model, num_drafts=num_drafts)
    s.add_request(request)
    plans = []
    while s.has_unfinished_requests():
        before = request.num_output_tokens
        out = s.schedule()
        plans.append((before, out))
        s.update_from_output(out, worker.execute(out))
    return plans


def test_drafts_never_reach_past_max_tokens():
    request = make_request(prompt_token_ids=[20, 21, 22] * 4, max_tokens=10, ignore_eos=True)
    plans = run_alone(request, num_drafts=8)
    assert request.output_token_ids == [looping_model(request.request_id, i) for i in range(10)]
    for before, out in plans:
        # it samples at output indices before .. before + drafts, all below max_tokens
        assert before + len(out.scheduled_spec_decode_tokens.get(request.request_id, [])) < 10
    assert any(out.scheduled_spec_decode_tokens for _, out in plans)


def test_drafts_beyond_what_a_request_may_take_are_not_scheduled():
    s = make_scheduler()
    penalised = make_request(prompt_token_ids=[5, 6, 7] * 3, max_tokens=10, presence_penalty=0.5)
    short = make_request(prompt_token_ids=[5, 6, 7] * 3, max_tokens=3, ignore_eos=True)
    early = make_request(prompt_token_ids=[5, 6, 7] * 3, max_tokens=10, min_tokens=4, ignore_eos=True)
    for r in (penalised, short, early):
        s.add_request(r)
    out = s.schedule()
    drafts = {r.request_id: [5, 6, 7, 5] for r in (penalised, short, early)}
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={rid: [7] for rid in drafts}, spec_token_ids=drafts))
    plan = s.schedule()
    # a penalty makes tokens depend on the outputs before them; max_tokens 3 leaves one draft after
    # the token the step samples anyway; min_tokens bans depend on the position until it is reached
    assert plan.scheduled_spec_decode_tokens == {short.request_id: [5]}
    assert plan.num_scheduled_tokens == {penalised.request_id: 1, short.request_id: 2, early.request_id: 1}


def test_a_rejected_draft_is_computed_again_and_the_count_rolls_back():
    s = make_scheduler()
    request = make_request(prompt_token_ids=[5, 6, 7, 5, 6, 7, 5, 6], max_tokens=10, ignore_eos=True)
    s.add_request(request)
    out = s.schedule()
    rid = request.request_id
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={rid: [7]}, spec_token_ids={rid: [5, 6, 7]}))
    assert request.spec_token_ids == [5, 6, 7]
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {rid: [5, 6, 7]}
    assert out.num_scheduled_tokens[rid] == 4 and out.total_num_scheduled_tokens == 4
    assert request.spec_token_ids == []  # used up by the plan
    before = request.num_computed_tokens
    # the worker sampled 5 (= draft 0), then 9 (draft 1 was 6): keeps [5, 9]
    results = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={rid: [5, 9]}))
    assert results[0].new_token_ids == [5, 9] and results[0].first_index == 1
    assert request.num_computed_tokens == before + 2  # its last token and draft 0; draft 1's position again
    assert request.num_tokens - request.num_computed_tokens == 1
    assert s.schedule().num_scheduled_tokens == {rid: 1}  # no drafts proposed this time


def test_tokens_after_a_stop_among_the_drafts_are_dropped():
    s = make_scheduler()
    request = make_request(prompt_token_ids=[5, 6, 7, 5, 6, 7, 5, 6], max_tokens=10, stop_token_ids=[6])
    rid = request.request_id
    s.add_request(request)
    s.update_from_output(s.schedule(), ModelRunnerOutput(sampled_token_ids={rid: [7]}, spec_token_ids={rid: [5, 6, 7]}))
    results = s.update_from_output(s.schedule(), ModelRunnerOutput(sampled_token_ids={rid: [5, 6, 7, 8]}))
    assert results[0].new_token_ids == [5, 6] and results[0].finished
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.get_num_free_blocks() == s.kv_cache_manager.num_total_blocks


def two_decoding_with_drafts(s, drafts: list[int]) -> list[str]:
    """Two 3-token prompts prefilled in one step, each given ``drafts``; their ids."""
    requests = [make_request(prompt_token_ids=[5, 6, 5], max_tokens=10, ignore_eos=True) for _ in range(2)]
    for r in requests:
        s.add_request(r)
    out = s.schedule()
    ids = [r.request_id for r in requests]
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={rid: [6] for rid in ids},
                                                spec_token_ids={rid: list(drafts) for rid in ids}))
    return ids


def test_drafts_that_do_not_fit_the_budget_are_dropped_not_the_requests():
    s = make_scheduler(max_num_batched_tokens=6)
    ids = two_decoding_with_drafts(s, [7, 5, 6])
    plan = s.schedule()  # 2 + 6 drafts > 6: the step goes without drafts
    assert plan.scheduled_spec_decode_tokens == {} and plan.num_scheduled_tokens == dict.fromkeys(ids, 1)


@pytest.mark.parametrize("num_drafts", [0, 3])
def test_a_step_with_drafts_has_a_continuation_with_the_workers_own(num_drafts):
    s = make_scheduler(block_size=4)
    request = make_request(prompt_token_ids=[5, 6, 7, 5, 6, 7, 5, 6], max_tokens=20, ignore_eos=True)
    rid = request.request_id
    s.add_request(request)
    proposal = {rid: [5, 6, 7][:num_drafts]} if num_drafts else {}
    s.update_from_output(s.schedule(), ModelRunnerOutput(sampled_token_ids={rid: [7]}, spec_token_ids=proposal))
    plan = s.schedule()
    assert bool(plan.scheduled_spec_decode_tokens) == bool(num_drafts)
    # how many drafts the worker keeps is its to know: the continuation decodes from its last
    # token as the worker has it, with up to the longest proposal seen of the worker's own drafts
    following = s.schedule_continuation(plan)
    assert following.continuation and following.num_own_drafts == num_drafts
    assert following.num_scheduled_tokens == {rid: 1} and not following.scheduled_spec_decode_tokens
    # 9 tokens known; ``plan`` may add 1 + drafts, the continuation computes the last of those and
    # its own drafts: blocks for every slot up to there
    assert len(s.kv_cache_manager.get_block_ids(rid)) * 4 >= 9 + (1 + num_drafts) + num_drafts
    # two drafts accepted in ``plan``, then the continuation's own (the worker's next proposal) all
    accepted = [5, 6, 7, 5][:1 + min(2, num_drafts)]
    s.update_from_output(plan, ModelRunnerOutput(sampled_token_ids={rid: accepted}, spec_token_ids=proposal))
    assert request.num_computed_tokens == len(request.all_token_ids) - 1
    own = [6, 7, 5, 6][:1 + num_drafts]
    [o] = s.update_from_output(following, ModelRunnerOutput(sampled_token_ids={rid: own}))
    assert o.new_token_ids == own and request.num_computed_tokens == len(request.all_token_ids) - 1


def test_a_continuation_takes_no_more_than_the_drafts_it_allowed():
    s = make_scheduler(block_size=4)
    request = make_request(prompt_token_ids=[5, 6, 7, 5, 6, 7, 5, 6], max_tokens=20, ignore_eos=True)
    rid = request.request_id
    s.add_request(request)
    s.update_from_output(s.schedule(), ModelRunnerOutput(sampled_token_ids={rid: [7]}, spec_token_ids={rid: [5, 6]}))
    plan = s.schedule()
    following = s.schedule_continuation(plan)
    assert following.num_own_drafts == 2
    s.update_from_output(plan, ModelRunnerOutput(sampled_token_ids={rid: [5]}))
    [o] = s.update_from_output(following, ModelRunnerOutput(sampled_token_ids={rid: [1, 2, 3, 4, 5]}))
    assert o.new_token_ids == [1, 2, 3]  # its last token's sample and two drafts' at most


def test_max_drafts_is_the_one_rule():
    params = SamplingParams(max_tokens=10, min_tokens=2, temperature=0.8, top_p=0.9, seed=1)
    assert [params.max_drafts(n) for n in (0, 1, 2, 8, 9)] == [0, 0, 7, 1, 0]
    assert SamplingParams(logit_bias={5: 1.0}).speculable
    assert not SamplingParams(logprobs=0).speculable
    assert not SamplingParams(repetition_penalty=1.1).max_drafts(0)


def test_drafts_never_take_a_block_another_request_needs():
    # 4-token blocks, 4 usable: two requests of 3 prompt tokens each take a block apiece; after their
    # first token each has a full block and needs a second for its next token: 2 free blocks, 2 needed
    s = make_scheduler(num_blocks=5)
    ids = two_decoding_with_drafts(s, [5, 6, 5, 6, 5])
    plan = s.schedule()
    assert not plan.preempted_req_ids and plan.num_scheduled_tokens == dict.fromkeys(ids, 1)
    assert plan.scheduled_spec_decode_tokens == {}  # their drafts would need blocks of their own


def test_drafts_leave_the_budget_of_the_waiting_head_alone():
    s = make_scheduler(max_num_batched_tokens=12)
    first = make_request(prompt_token_ids=[5, 6, 5], max_tokens=10, ignore_eos=True)
    s.add_request(first)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={first.request_id: [6]},
                                                spec_token_ids={first.request_id: [5, 6, 5]}))
    s.add_request(make_request(10, max_tokens=4))  # its 10 tokens and the decode's 1 leave 1 of 12
    plan = s.schedule()
    assert plan.scheduled_spec_decode_tokens == {}
    assert sorted(plan.num_scheduled_tokens.values()) == [1, 10]


def test_an_aborted_request_leaves_no_drafts_behind():
    s = make_scheduler()
    request = make_request(prompt_token_ids=[5, 6, 7, 5, 6, 7, 5, 6], max_tokens=10, ignore_eos=True)
    rid = request.request_id
    s.add_request(request)
    s.update_from_output(s.schedule(), ModelRunnerOutput(sampled_token_ids={rid: [7]}, spec_token_ids={rid: [5, 6]}))
    s.abort([rid])
    assert request.spec_token_ids == [] and not s._drafted
    assert s.schedule().scheduled_spec_decode_tokens == {}
