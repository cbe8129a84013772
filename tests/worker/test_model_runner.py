"""ModelRunner driven by hand-made step diffs (no scheduler): the persistent batch follows the
diffs, chunked prefill and decode match transformers' greedy tokens, only sampling rows sample."""

from __future__ import annotations

import pytest
import torch

from servicekit.contract.errors import InvalidArgumentError
from worker.factories import hf_greedy, make_hf_model, make_runner, new_req, random_prompts, step
from worker_service.config import ModelRunnerConfig
from worker_service.kv_cache import bytes_per_block


@pytest.fixture(scope="module")
def hf():
    return make_hf_model()


def test_info_reports_blocks_limits_and_eos(hf):
    runner = make_runner(hf, num_blocks=50, block_size=8, max_model_len=200)
    info = runner.info
    assert (info.num_blocks, info.block_size, info.max_model_len) == (50, 8, 200)
    assert info.vocab_size == 512 and info.eos_token_ids == (2,)
    assert runner.kv_caches[0][0].shape == (50, 8, 2, 16)
    assert runner.attention_backend == "torch"


def test_the_worker_states_its_prefill_attention_limit_by_device(hf):
    """A CPU worker states the CPU's cap per prefill chunk (auto); a configured value wins; the
    statement survives Describe and the Redis registry, where a scheduler reads it."""
    from servicekit.contract.worker import CPU_PREFILL_CHUNK_ATTENTION_LIMIT
    from servicekit.proto.step import worker_description_from_pb, worker_description_to_pb
    from servicekit.registry import worker_from_hash, worker_to_hash

    auto = make_runner(hf).info
    assert auto.prefill_chunk_attention_limit == CPU_PREFILL_CHUNK_ATTENTION_LIMIT == 1 << 20
    assert make_runner(hf, prefill_chunk_attention_limit=0).info.prefill_chunk_attention_limit == 0
    stated = make_runner(hf, prefill_chunk_attention_limit=5000).info
    assert stated.prefill_chunk_attention_limit == 5000
    assert worker_description_from_pb(worker_description_to_pb(stated)) == stated
    assert worker_from_hash(worker_to_hash(stated)) == stated
    with pytest.raises(InvalidArgumentError, match="prefill_chunk_attention_limit"):
        ModelRunnerConfig(model="x", prefill_chunk_attention_limit=-2)


def test_num_blocks_follow_the_memory_budget(hf):
    runner = make_runner(hf, num_blocks=None, kv_cache_memory="1MiB", block_size=4)
    per_block = bytes_per_block(runner.model.cfg, 4, torch.float32)  # 2 layers * 2 * 4 * 2 * 16 * 4 bytes
    assert per_block == 2048
    assert runner.info.num_blocks == (1 << 20) // per_block
    # never more than every sequence at full length can use
    capped = make_runner(hf, num_blocks=None, kv_cache_memory="1GiB", block_size=4, max_model_len=64, max_num_seqs=2)
    assert capped.info.num_blocks == 2 * 16 + 1


def test_chunked_prefill_then_decode_matches_transformers(hf):
    runner = make_runner(hf)
    prompt = random_prompts([11])[0]
    blocks = [3, 7, 1, 9, 12, 4, 5, 6, 8, 10]  # any order: the table maps positions to blocks
    expected = hf_greedy(hf, prompt, 8)

    out = runner.execute_model(step([new_req("a", prompt, blocks)], num_scheduled={"a": 5}))
    assert out.sampled_token_ids == {}  # a partial chunk samples nothing
    out = runner.execute_model(step(cached=[("a", [], 5)], num_scheduled={"a": 6}))
    tokens = out.sampled_token_ids["a"]
    for i in range(7):
        out = runner.execute_model(step(cached=[("a", [], 11 + i)], num_scheduled={"a": 1}))
        tokens += out.sampled_token_ids["a"]
    assert tokens == expected


def test_batch_of_prefills_and_decodes_in_one_step(hf):
    runner = make_runner(hf)
    p1, p2 = random_prompts([6, 9], seed=5)
    out = runner.execute_model(step([new_req("a", p1, [1, 2])], num_scheduled={"a": 6}))
    first = out.sampled_token_ids["a"]
    # "a" decodes while "b" prefills in the same step
    out = runner.execute_model(step([new_req("b", p2, [3, 4, 5])], [("a", [], 6)],
                                    num_scheduled={"a": 1, "b": 9}))
    assert out.sampled_token_ids["a"] == hf_greedy(hf, p1, 2)[1:] and first == hf_greedy(hf, p1, 1)
    assert out.sampled_token_ids["b"] == hf_greedy(hf, p2, 1)


def test_finished_and_preempted_requests_leave_the_batch(hf):
    runner = make_runner(hf, max_num_seqs=2)
    p1, p2, p3 = random_prompts([4, 4, 4], seed=1)
    runner.execute_model(step([new_req("a", p1, [1]), new_req("b", p2, [2])], num_scheduled={"a": 4, "b": 4}))
    assert len(runner.batch) == 2
    out = runner.execute_model(step([new_req("c", p3, [3])], finished={"a"}, preempted={"b"}, num_scheduled={"c": 4}))
    assert set(runner.batch.rows) == {"c"} and "c" in out.sampled_token_ids
    # a preempted request comes back as new, with the outputs it already has, and continues exactly
    first = hf_greedy(hf, p2, 3)
    out = runner.execute_model(step([new_req("b", p2, [4, 5], outputs=first[:1])], num_scheduled={"b": 5}))
    assert out.sampled_token_ids["b"] == first[1:2]


def test_prefix_hit_computes_only_the_rest(hf):
    runner = make_runner(hf)
    prompt = random_prompts([12], seed=2)[0]
    runner.execute_model(step([new_req("a", prompt, [1, 2, 3])], num_scheduled={"a": 12}))
    # "b" shares the first 8 tokens (two full blocks) and is told they are computed
    other = prompt[:8] + random_prompts([3], seed=9)[0]
    out = runner.execute_model(step([new_req("b", other, [1, 2, 4], num_computed_tokens=8)], num_scheduled={"b": 3},
                                    finished={"a"}))
    assert out.sampled_token_ids["b"] == hf_greedy(hf, other, 1)


def test_empty_step_and_unknown_request(hf):
    runner = make_runner(hf)
    assert runner.execute_model(step(num_scheduled={})).sampled_token_ids == {}
    with pytest.raises(KeyError):
        runner.execute_model(step(cached=[("nope", [], 0)], num_scheduled={"nope": 1}))


def test_logprobs_come_back_for_requests_that_ask(hf):
    runner = make_runner(hf)
    p1, p2 = random_prompts([5, 5], seed=4)
    out = runner.execute_model(step([new_req("a", p1, [1, 2], logprobs=3), new_req("b", p2, [3, 4])],
                                    num_scheduled={"a": 5, "b": 5}))
    assert set(out.logprobs) == {"a"}
    (lp,) = out.logprobs["a"]
    with torch.inference_mode():
        raw = torch.log_softmax(hf(torch.tensor([p1])).logits[0, -1], -1)
    assert lp.token_id == out.sampled_token_ids["a"][0] == int(raw.argmax())
    assert abs(lp.logprob - float(raw.max())) < 1e-4
    assert [t for t, _ in lp.top] == raw.topk(3).indices.tolist()


def test_min_tokens_bans_eos_until_reached(hf):
    runner = make_runner(hf)
    prompt = random_prompts([5], seed=6)[0]
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    # make EOS the greedy choice through a stop token id: ban it with min_tokens
    best = int(logits.argmax())
    out = runner.execute_model(step([new_req("a", prompt, [1, 2], min_tokens=2, stop_token_ids=[best])],
                                    num_scheduled={"a": 5}))
    assert out.sampled_token_ids["a"] == [int(logits.topk(2).indices[1])]


def test_config_rejects_bad_values():
    with pytest.raises(InvalidArgumentError, match="kv_cache_memory"):
        ModelRunnerConfig(model="x", kv_cache_memory="lots")
    with pytest.raises(InvalidArgumentError, match="attention_backend"):
        ModelRunnerConfig(model="x", attention_backend="cuda")
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        ModelRunnerConfig(model="x", num_blocks=1)


@pytest.mark.kernel
@pytest.mark.slow
def test_triton_backend_gives_the_same_tokens(hf):
    """The Triton kernels (the interpreter on a machine without CUDA) drive the same runner."""
    prompts = random_prompts([9, 3], seed=8)
    tokens = {}
    for backend in ("torch", "triton"):
        runner = make_runner(hf, attention_backend=backend)
        out = runner.execute_model(step([new_req("a", prompts[0], [1, 2, 3, 4]), new_req("b", prompts[1], [5, 6])],
                                        num_scheduled={"a": 9, "b": 3}))
        got = [out.sampled_token_ids["a"], out.sampled_token_ids["b"]]
        out = runner.execute_model(step(cached=[("a", [], 9), ("b", [], 3)],
                                        num_scheduled={"a": 1, "b": 1}))
        tokens[backend] = [got[0] + out.sampled_token_ids["a"], got[1] + out.sampled_token_ids["b"]]
        assert runner.attention_backend == backend
    assert tokens["triton"] == tokens["torch"]


def test_cpu_kv_cache_is_head_major_memory_behind_the_logical_layout(hf):
    runner = make_runner(hf, num_blocks=50, block_size=8, max_model_len=200)
    key_cache, value_cache = runner.kv_caches[0]
    assert key_cache.shape == (50, 8, 2, 16)  # [num_blocks, block_size, num_kv_heads, head_dim]
    assert key_cache.permute(2, 0, 1, 3).is_contiguous()  # memory: [num_kv_heads, num_blocks, ...]
    assert int(key_cache.abs().sum()) == 0 and int(value_cache.abs().sum()) == 0


def test_drafts_are_verified_as_one_token_steps_would_sample(hf):
    prompt = random_prompts([9], seed=6)[0]
    expected = hf_greedy(hf, prompt, 6)
    for drafts, kept in [(expected[1:4], expected[1:5]),  # all right: the three and the token after them
                         ([expected[1], 0, expected[3]], expected[1:3]),  # the second wrong: up to its correction
                         ([0, 1], expected[1:2])]:  # the first wrong: one token, as without drafts
        runner = make_runner(hf)
        first = runner.execute_model(step([new_req("a", prompt, [1, 2, 3])], num_scheduled={"a": 9}))
        assert first.sampled_token_ids["a"] == expected[:1]
        plan = step(cached=[("a", [], 9)], num_scheduled={"a": 1 + len(drafts)})
        plan.scheduled_spec_decode_tokens = {"a": list(drafts)}
        out = runner.execute_model(plan)
        assert out.sampled_token_ids["a"] == kept
        # the worker's copy holds the kept tokens: the next step continues after them
        plan = step(cached=[("a", [], 9 + len(kept))], num_scheduled={"a": 1})
        assert runner.execute_model(plan).sampled_token_ids["a"] == expected[1 + len(kept):2 + len(kept)]


def test_a_continuation_decodes_the_workers_last_token_and_its_own_drafts(hf):
    prompt = random_prompts([9], seed=6)[0]
    expected = hf_greedy(hf, prompt, 10)
    for own, num_own_drafts, kept in [
        (expected[1:4], 3, expected[1:5]),  # all right: the three and the token after them
        ([expected[1], 0, expected[3]], 3, expected[1:3]),  # the second wrong: up to its correction
        (expected[1:4], 1, expected[1:3]),  # the plan allows one
        (expected[1:4], 0, expected[1:2]),  # none allowed: one token
    ]:
        runner = make_runner(hf)
        first = runner.execute_model(step([new_req("a", prompt, [1, 2, 3, 4])], num_scheduled={"a": 9}))
        assert first.sampled_token_ids["a"] == expected[:1]
        runner._own_drafts["a"] = (10, list(own))  # stands for its prompt-lookup proposal with that answer
        # planned before that answer: the scheduler knows 9 tokens computed, the worker 10 tokens known
        plan = step(cached=[("a", [], 9)], num_scheduled={"a": 1})
        plan.continuation, plan.num_own_drafts = True, num_own_drafts
        assert runner.execute_model(plan).sampled_token_ids["a"] == kept
        # and the next continuation goes on after the kept tokens (no drafts proposed for them)
        plan = step(cached=[("a", [], 10)], num_scheduled={"a": 1})
        plan.continuation, plan.num_own_drafts = True, 3
        assert runner.execute_model(plan).sampled_token_ids["a"] == expected[1 + len(kept):2 + len(kept)]


def test_a_continuation_skips_a_request_that_has_all_of_its_max_tokens(hf):
    # planned while a's drafts were in flight: they were all accepted, so a has its 4 tokens; the
    # worker computes only b (no slot past a's last token is written) and samples only b
    prompts = random_prompts([9, 7], seed=6)
    expected = hf_greedy(hf, prompts[0], 4)
    runner = make_runner(hf)
    first = runner.execute_model(step([new_req("a", prompts[0], [1, 2, 3, 4], max_tokens=4),
                                       new_req("b", prompts[1], [5, 6, 7, 8])], num_scheduled={"a": 9, "b": 7}))
    assert first.sampled_token_ids["a"] == expected[:1]
    plan = step(cached=[("a", [], 9), ("b", [], 7)], num_scheduled={"a": 3, "b": 1})
    plan.scheduled_spec_decode_tokens = {"a": expected[1:3]}
    assert runner.execute_model(plan).sampled_token_ids["a"] == expected[1:4]  # a has its 4 tokens
    kv_before = [k.clone() for k, _ in runner.kv_caches]
    plan = step(cached=[("a", [], 10), ("b", [], 8)], num_scheduled={"a": 1, "b": 1})
    plan.continuation, plan.num_own_drafts = True, 3
    out = runner.execute_model(plan)
    assert set(out.sampled_token_ids) == {"b"}
    a_blocks = torch.tensor([1, 2, 3, 4])
    assert all(torch.equal(k[a_blocks], before[a_blocks]) for (k, _), before in zip(runner.kv_caches, kv_before))
    # a continuation of only such requests computes nothing
    plan = step(cached=[("a", [], 10)], num_scheduled={"a": 1})
    plan.continuation = True
    assert runner.execute_model(plan).sampled_token_ids == {}


def test_a_continuation_takes_only_drafts_for_the_tokens_the_worker_holds(hf):
    prompt = random_prompts([9], seed=6)[0]
    expected = hf_greedy(hf, prompt, 3)
    runner = make_runner(hf)
    runner.execute_model(step([new_req("a", prompt, [1, 2, 3, 4])], num_scheduled={"a": 9}))
    runner._own_drafts["a"] = (9, expected[1:3])  # proposed for an older token count: not used
    plan = step(cached=[("a", [], 10)], num_scheduled={"a": 1})
    plan.continuation, plan.num_own_drafts = True, 3
    assert runner.execute_model(plan).sampled_token_ids["a"] == expected[1:2]
    bad = step(cached=[("a", [], 11)], num_scheduled={"a": 2})
    bad.continuation = True
    with pytest.raises(ValueError, match="one token for each request"):
        runner.execute_model(bad)


def test_drafts_a_worker_cannot_verify_are_refused(hf):
    runner = make_runner(hf)
    prompt = random_prompts([9], seed=6)[0]
    runner.execute_model(step([new_req("a", prompt, [1, 2, 3]), new_req("p", prompt, [4, 5, 6], presence_penalty=1.0)],
                              num_scheduled={"a": 9, "p": 9}))
    for plan, drafts, match in [
        (step(cached=[("p", [], 9)], num_scheduled={"p": 2}), {"p": [5]}, "depends on its outputs"),
        (step(cached=[("a", [], 9)], num_scheduled={"a": 2}), {"b": [5]}, "does not schedule"),
        (step(cached=[("a", [], 8)], num_scheduled={"a": 2}), {"a": [5]}, "does not decode them"),
        (step(cached=[("a", [], 9)], num_scheduled={"a": 2}), {"a": [10**6]}, "outside the vocabulary"),
    ]:
        plan.scheduled_spec_decode_tokens = drafts
        with pytest.raises(ValueError, match=match):
            runner.execute_model(plan)
