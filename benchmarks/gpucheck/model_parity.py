"""Section 2: the engine's greedy tokens against transformers' on the same device.

The tiny random Llama and Qwen2 of the engine tests (``tests/worker/factories.py``), in fp32:
``pagedserve.LLM`` must give transformers' ``generate(do_sample=False)`` tokens exactly — all
prompts in one batch, with prefill chunked, and with a KV cache too small for all requests at once
(preemption by recompute). Then bf16: how far the engine's bf16 tokens follow its fp32 tokens
(greedy paths of a random model part at near-ties, so this is reported, with a loose floor).
"""

from __future__ import annotations

from gpucheck.common import Context, log

REAL_LENGTHS, REAL_TOKENS = [1, 5, 17, 40, 64, 100, 150], 32
DRY_LENGTHS, DRY_TOKENS = [9, 17, 21], 8


def modes(dry: bool) -> dict[str, dict]:
    """Engine options per mode; "preempt" fits the longest request but not all at once."""
    return {
        "batch": dict(),
        "chunked": dict(max_num_batched_tokens=24),
        "preempt": dict(num_blocks=10, block_size=4) if dry else dict(num_blocks=16, block_size=16),
    }
BF16_MIN_AGREEMENT = 0.5  # mean share of each output before its first difference from fp32


def agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    """Mean over requests of the share of tokens before the first difference."""
    shares = []
    for a, b in zip(ours, reference, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(same / max(len(b), 1))
    return sum(shares) / len(shares)


def run(ctx: Context) -> dict:
    from worker.factories import hf_greedy, make_hf_model, random_prompts

    from pagedserve import LLM, SamplingParams

    lengths, num_tokens = (DRY_LENGTHS, DRY_TOKENS) if ctx.dry else (REAL_LENGTHS, REAL_TOKENS)
    greedy = SamplingParams(max_tokens=num_tokens, min_tokens=num_tokens, temperature=0.0)
    prompts = random_prompts(lengths, seed=42)
    results: dict = dict(passed=True, families={})
    for family in ("llama", "qwen2"):
        hf = make_hf_model(family).to(ctx.device)
        reference = [hf_greedy(hf, p, num_tokens) for p in prompts]
        rows: dict = {}
        fp32_tokens = None
        for mode, options in modes(ctx.dry).items():
            llm = LLM(family, hf_model=hf, device=ctx.device, dtype="float32", skip_tokenizer_init=True, **options)
            tokens = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            preemptions = llm.scheduler.stats().num_preemptions
            matches = sum(t == r for t, r in zip(tokens, reference))
            ok = matches == len(prompts) and (mode != "preempt" or preemptions > 0)
            rows[mode] = dict(matching_prompts=matches, prompts=len(prompts), preemptions=preemptions,
                              attention_backend=llm.runner.attention_backend, passed=ok)
            log(f"{family} fp32 {mode}: {matches}/{len(prompts)} prompts match transformers, "
                f"{preemptions} preemptions, backend {llm.runner.attention_backend}")
            fp32_tokens = fp32_tokens or tokens
            del llm
        bf16 = LLM(family, hf_model=hf, device=ctx.device, dtype="bfloat16", skip_tokenizer_init=True)
        bf16_tokens = [o.token_ids for o in bf16.generate(prompts, greedy, use_tqdm=False)]
        share = agreement(bf16_tokens, fp32_tokens)
        first = sum(a[:1] == b[:1] for a, b in zip(bf16_tokens, fp32_tokens)) / len(prompts)
        rows["bf16_vs_fp32"] = dict(mean_agreement=share, first_token_agreement=first,
                                    passed=share >= BF16_MIN_AGREEMENT)
        log(f"{family} bf16 vs fp32: {share:.1%} of tokens before the first difference, first token {first:.0%}")
        del bf16, hf
        results["families"][family] = rows
        results["passed"] &= all(r["passed"] for r in rows.values())
    return results
