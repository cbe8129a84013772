"""Greedy decoding through ``LLM.generate`` matches transformers' ``generate(do_sample=False)``
token for token — all prompts in one batch, with prefill chunked, and with requests preempted — in
fp32 (pinned: ``auto`` picks bf16 on CPUs with native bf16; bf16's agreement is in test_bf16.py)."""

from __future__ import annotations

import pytest
from worker.factories import hf_greedy, random_prompts

from paged_kernels import cpu
from pagedserve import LLM, SamplingParams

NUM_TOKENS = 32
# max_tokens = min_tokens: exactly NUM_TOKENS tokens, EOS banned until then (HF's min_new_tokens)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0.0)
TINY_LENGTHS = [1, 5, 17, 40, 64, 100, 150]

# engine options per mode; "preempt" has room for the longest request but not for all at once
TINY_MODES = {
    "batch": dict(),
    "chunked": dict(max_num_batched_tokens=24),
    "preempt": dict(num_blocks=16, block_size=16),
}


def run_mode(model: str, prompts, mode: dict, **kwargs):
    llm = LLM(model, skip_tokenizer_init=True, dtype="float32", **mode, **kwargs)
    if kwargs.get("attention_backend") == "cpu" and cpu.available():
        assert llm.runner.attention_backend == "cpu"
    outputs = llm.generate(prompts, GREEDY)
    return [o.token_ids for o in outputs], llm.scheduler.stats().num_preemptions


def check_mode(name: str, outputs, preemptions: int, references) -> None:
    for i, (got, want) in enumerate(zip(outputs, references)):
        assert got == want, f"{name}: prompt {i} diverges at token {next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)}"
    if name == "preempt":
        assert preemptions > 0, "the KV cache was meant to be too small for all requests at once"


@pytest.fixture(scope="module")
def tiny_references(tiny_llama, tiny_qwen2):
    prompts = random_prompts(TINY_LENGTHS, seed=42)
    return prompts, {
        "llama": [hf_greedy(tiny_llama.hf, p, NUM_TOKENS) for p in prompts],
        "qwen2": [hf_greedy(tiny_qwen2.hf, p, NUM_TOKENS) for p in prompts],
    }


@pytest.mark.parametrize("mode", sorted(TINY_MODES))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])  # C decode rows, and the reference alone
def test_tiny_model_greedy_matches_transformers(backend, family, mode, tiny_llama, tiny_qwen2, tiny_references):
    prompts, references = tiny_references
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}[family]
    outputs, preemptions = run_mode(model.path, prompts, TINY_MODES[mode], attention_backend=backend)
    check_mode(mode, outputs, preemptions, references[family])


SMOL_QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain, in two sentences, why the sky is blue.",
    "List three prime numbers and explain how you know each of them is prime. " * 3,
    "Summarise the following text. " + "The quick brown fox jumps over the lazy dog near the river bank. " * 16,
]
SMOL_MODES = {
    "batch": dict(),
    "chunked": dict(max_num_batched_tokens=64),
    "preempt": dict(num_blocks=40, block_size=16),
}


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2):
    tok = smollm2.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in SMOL_QUESTIONS]
    prompts = [tok.encode(p, add_special_tokens=False) for p in prompts]
    lengths = sorted(len(p) for p in prompts)
    assert len(set(lengths)) == len(lengths) and lengths[-1] > 200, lengths
    references = [hf_greedy(smollm2.hf, p, NUM_TOKENS) for p in prompts]
    for name, mode in SMOL_MODES.items():
        outputs, preemptions = run_mode("smollm2-135m", prompts, mode, hf_model=smollm2.hf)
        check_mode(name, outputs, preemptions, references)
