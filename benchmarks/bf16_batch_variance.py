"""Does a request's greedy output depend on its batch neighbours? (docs/operations.md, "Faults")

Runs random token-id prompts all together and then each alone through ``pagedserve.LLM`` and counts
the prompts whose greedy tokens differ. In float32 none should; in bfloat16 rounding in GEMMs of
other shapes can move a near-tie, which is why replay after a fault is bit-exact only in float32.

    python benchmarks/bf16_batch_variance.py --dtype bfloat16     # printed 1 of 12 on the 2-core host
    python benchmarks/bf16_batch_variance.py --dtype float32
"""

from __future__ import annotations

import argparse
import random


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    from pagedserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False)
    rng = random.Random(args.seed)
    vocab = llm.info.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(20, 200))] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    differ = [i for i, (a, b) in enumerate(zip(together, alone)) if a != b]
    print(f"{args.dtype}: {len(differ)} of {len(prompts)} prompts' {args.max_tokens} greedy tokens differ alone vs "
          f"in a batch of {len(prompts)} (prompts {differ})")


if __name__ == "__main__":
    main()
