"""N-gram speculation end to end in process: drafts change how many steps a request takes, never its
tokens (fp32: greedy and seeded sampling token for token what one-token steps give)."""

from __future__ import annotations

import pytest
from worker.factories import random_prompts

from pagedserve import LLM, SamplingParams

# prompts that repeat themselves (a small model continues such a pattern, so drafts are often right),
# and random ones (drafts rare, mostly wrong)
LOOPING = [[5, 6, 7, 8] * 6, [40, 41] * 10 + [42], [9, 10, 11, 9, 10, 11, 12] * 3]
PARAMS = [
    SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.7, top_k=20, seed=6, ignore_eos=True, logit_bias={7: 3.0}),
    SamplingParams(max_tokens=30, temperature=0.0, min_tokens=10, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.2, ignore_eos=True),  # never drafted
    SamplingParams(max_tokens=30, temperature=0.0, logprobs=2, ignore_eos=True),  # never drafted
]


def run(llm: LLM, prompts, params):
    """Outputs, and per step (the draft tokens it carried, the drafts the worker kept)."""
    steps = []
    execute = llm.runner.execute_model

    def recording(plan):
        result = execute(plan)
        drafts = plan.scheduled_spec_decode_tokens
        kept = sum(len(result.sampled_token_ids[rid]) - 1 for rid in drafts if rid in result.sampled_token_ids)
        steps.append((sum(map(len, drafts.values())), kept))
        return result

    llm.runner.execute_model = recording
    try:
        outputs = llm.generate(prompts, params)
    finally:
        llm.runner.execute_model = execute
    return outputs, steps


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_drafts_change_the_steps_not_the_tokens(smollm2, backend):
    # SmolLM2 continues a repeated pattern (or falls into one), so many drafts are right
    tok = smollm2.tokenizer
    prompts = [*LOOPING, tok.encode("The days of the week are Monday, Tuesday, Wednesday,"),
               tok.encode("Write a poem about the sea."), *random_prompts([30, 17], seed=3, vocab=49152)]
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    settings = dict(skip_tokenizer_init=True, attention_backend=backend, dtype="float32", hf_model=smollm2.hf)
    expected, plain_steps = run(LLM("smollm2-135m", num_speculative_tokens=0, **settings), prompts, params)
    got, steps = run(LLM("smollm2-135m", num_speculative_tokens=4, **settings), prompts, params)
    assert not any(n for n, _ in plain_steps)
    assert sum(k for _, k in steps) > sum(len(o.token_ids) for o in got) // 10  # some were right
    assert len(steps) < len(plain_steps)
    for a, b in zip(expected, got):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
    assert got[5].logprobs is not None and len(got[5].logprobs) == len(got[5].token_ids)


def test_drafts_with_chunked_prefill_and_preemption_keep_the_tokens(tiny_llama):
    # the torch backend: its chunk and decode rows agree in fp32 whatever the head size (the CPU
    # backend's do where its row kernel serves chunks: AVX-512, head sizes 64 and 128)
    prompts = [*LOOPING, *random_prompts([30, 17, 50, 9], seed=4)]
    params = [PARAMS[i % 3] for i in range(len(prompts))]
    small = dict(num_blocks=20, block_size=8, max_num_batched_tokens=24, attention_backend="torch")
    expected, _ = run(LLM(tiny_llama.path, skip_tokenizer_init=True, num_speculative_tokens=0, **small),
                      prompts, params)
    drafted = LLM(tiny_llama.path, skip_tokenizer_init=True, num_speculative_tokens=5, **small)
    got, steps = run(drafted, prompts, params)
    assert sum(k for _, k in steps) > 0 and drafted.scheduler.stats().num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def pipelined(llm: LLM, prompts, params) -> tuple[list[list[int]], int, int]:
    """The scheduler service's loop in miniature, on ``llm``'s scheduler and runner: each step's
    continuation planned while the step is in flight (the runner runs steps in the order sent,
    each one as it is sent), then the step's results applied. Returns (each prompt's tokens, steps
    planned ahead, tokens the continuations' own drafts added)."""
    from scheduler_service.core import Request

    s, runner = llm.scheduler, llm.runner
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        s.add_request(Request(rid, list(prompt), p))
    tokens = {rid: [] for rid in ids}
    ahead = own = 0
    current = None
    while True:
        if current is None:
            plan = s.schedule()
            if plan.is_empty:
                if not s.has_unfinished_requests():
                    break
                continue
            current = (plan, runner.execute_model(plan))
        following = s.schedule_continuation(current[0])
        sent = None
        if following is not None:
            sent = (following, runner.execute_model(following))
            ahead += 1
            own += sum(len(t) - 1 for t in sent[1].sampled_token_ids.values())
        for o in s.update_from_output(*current):
            tokens[o.request_id].extend(o.new_token_ids)
        current = sent
    return [tokens[rid] for rid in ids], ahead, own


def test_steps_planned_ahead_verify_the_workers_own_drafts_and_keep_the_tokens(tiny_llama):
    # a continuation carries no drafts from the scheduler: the runner verifies those it proposed with
    # the step before, after the last token it holds; the tokens are one-token steps' (fp32)
    prompts = [*LOOPING, *random_prompts([30, 17, 50, 9], seed=4)]
    params = [PARAMS[i % 4] for i in range(len(prompts))]
    settings = dict(skip_tokenizer_init=True, attention_backend="torch", dtype="float32")
    expected = LLM(tiny_llama.path, num_speculative_tokens=0, **settings).generate(prompts, params)
    drafted = LLM(tiny_llama.path, num_speculative_tokens=4, **settings)
    got, ahead, own = pipelined(drafted, prompts, params)
    assert got == [o.token_ids for o in expected]
    assert ahead > 10 and own > 0 and drafted.scheduler.own_draft_limit == 4
