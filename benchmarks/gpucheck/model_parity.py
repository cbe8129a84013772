"""Section 2: the engine's greedy tokens against transformers' on the same device.

The tiny random Llama and Qwen2 of the engine tests (``tests/worker/factories.py``), in fp32:
``pagedserve.LLM`` must give transformers' ``generate(do_sample=False)`` tokens exactly — all
prompts in one batch, with prefill chunked, and with a KV cache too small for all requests at once
(preemption by recompute); the prompt logprobs of chunked prompts against transformers'
log-softmax. Then bf16, judged on fp32's path: the fp32 prompts plus fp32's greedy tokens are fed
to the bf16 engine as prompts (teacher forcing), and at each generated position fp32's token must be
bf16's first choice in most positions and never below its third. A free-running greedy path of a
random model parts from fp32's at its first near-tie and never returns, so how long the free paths
agree is reported, not judged (0.47-0.63 on an H100 and on the CPU alike).
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
# bf16 on fp32's path: share of positions where fp32's token is bf16's top choice (0.94-0.96 on the
# CPU), and the lowest rank fp32's token may have in bf16's distribution there (near-ties only)
BF16_MIN_TOP1 = 0.85
BF16_MAX_RANK = 3
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


def bf16_row(bf16, prompts: list[list[int]], fp32_tokens: list[list[int]]) -> dict:
    """bf16 teacher-forced on fp32's greedy path: the rank of fp32's token in bf16's distribution at
    every generated position (prompt logprobs of prompt + fp32 output)."""
    from pagedserve import SamplingParams

    forced = [p + t for p, t in zip(prompts, fp32_tokens)]
    outputs = bf16.generate(forced, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    ranks = [lp.rank for p, o in zip(prompts, outputs) for lp in o.prompt_logprobs[len(p) - 1:]]
    top1 = sum(r == 1 for r in ranks) / len(ranks)
    return dict(positions=len(ranks), top1_share=top1, worst_rank=max(ranks),
                passed=top1 >= BF16_MIN_TOP1 and max(ranks) <= BF16_MAX_RANK)


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
        row = bf16_row(bf16, prompts, fp32_tokens)
        rows["bf16_vs_fp32"] = dict(row, free_running_agreement=share, first_token_agreement=first)
        log(f"{family} bf16 on fp32's path: fp32's token bf16's first choice at {row['top1_share']:.1%} of "
            f"{row['positions']} positions, worst rank {row['worst_rank']}; free-running: {share:.1%} of "
            f"tokens before the first difference, first token {first:.0%}")
        del bf16, hf
        results["families"][family] = rows
        results["passed"] &= all(r["passed"] for r in rows.values())
    return results
