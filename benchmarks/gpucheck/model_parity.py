"""Section 2: the engine's greedy tokens against transformers' on the same device.

The tiny random Llama and Qwen2 of the engine tests (``tests/worker/factories.py``), in fp32:
``pagedserve.LLM`` must give transformers' ``generate(do_sample=False)`` tokens exactly — all
prompts in one batch, with prefill chunked, and with a KV cache too small for all requests at once
(preemption by recompute); the prompt logprobs of chunked prompts against transformers'
log-softmax. Then bf16: how far the engine's bf16 tokens follow its fp32 tokens (greedy paths of a
random model part at near-ties, so this is reported, with a loose floor).
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
PROMPT_LOGPROBS_TOLERANCE = 1e-3  # fp32: largest |ours - transformers'| of a prompt token's logprob


def agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    """Mean over requests of the share of tokens before the first difference."""
    shares = []
    for a, b in zip(ours, reference, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(same / max(len(b), 1))
    return sum(shares) / len(shares)


def prompt_logprobs_row(llm, hf, prompts: list[list[int]]) -> dict:
    """Each prompt's token logprobs (SamplingParams.prompt_logprobs) against transformers' log-softmax
    of the same positions."""
    import torch

    from pagedserve import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(prompts, outputs):
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=hf.device)
            reference = torch.log_softmax(hf(ids).logits[0, :-1].float(), dim=-1)
        expected = reference.gather(1, ids[0, 1:, None])[:, 0].cpu()
        got = torch.tensor([lp.logprob for lp in out.prompt_logprobs])
        worst = max(worst, (got - expected).abs().max().item() if len(got) else 0.0)
    return dict(max_abs_diff=worst, passed=worst <= PROMPT_LOGPROBS_TOLERANCE)


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
            if mode == "chunked":
                rows["prompt_logprobs"] = prompt_logprobs_row(llm, hf, prompts)
                log(f"{family} fp32 prompt logprobs (chunked): largest difference from transformers "
                    f"{rows['prompt_logprobs']['max_abs_diff']:.1e}")
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
