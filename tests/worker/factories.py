"""Factories for worker and engine tests: tiny random Hugging Face models, runners, step diffs.

Tiny models use a large init scale so that logits are well separated: greedy argmax then does not
flip on float rounding differences between our packed/paged forward pass and transformers'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import CachedRequestData, NewRequestData, SchedulerOutput

TINY_VOCAB = 512
TINY_EOS = 2

_COMMON = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=TINY_EOS, pad_token_id=0,
)


def make_hf_config(family: str = "llama", **overrides: Any) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    values = dict(_COMMON)
    if family == "llama":
        values.update(tie_word_embeddings=False)
        values.update(overrides)
        return LlamaConfig(**values)
    if family == "qwen2":
        values.update(tie_word_embeddings=True, use_sliding_window=False)
        values.update(overrides)
        return Qwen2Config(**values)
    raise ValueError(family)


def make_hf_model(family: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """A tiny random transformers causal LM (eval mode, fp32), reproducible from ``seed``."""
    from transformers import AutoModelForCausalLM

    config = make_hf_config(family, **overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("proj.bias"):  # HF zero-inits biases; make Qwen2's QKV bias matter
                    param.normal_(0.0, 0.5)
                elif name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
    return model.eval()


def save_hf_model(path: Path, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    make_hf_model(family, seed, **overrides).save_pretrained(path)
    return path


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = TINY_VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf_model: Any, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers ``generate(do_sample=False)`` of exactly ``num_tokens`` tokens (EOS masked until
    then, like our ``min_tokens``)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=hf_model.device)
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def make_runner(hf_model: Any, **overrides: Any) -> Any:
    """A ModelRunner over ``hf_model``'s weights (CPU, fp32 — tests compare with transformers' fp32
    greedy tokens —, torch attention unless overridden)."""
    from worker_service.config import ModelRunnerConfig
    from worker_service.model_runner import ModelRunner

    values: dict[str, Any] = dict(model="tiny", dtype="float32", device="cpu", num_blocks=64, block_size=4, max_model_len=256,
                                  max_num_seqs=8, attention_backend="torch")
    values.update(overrides)
    return ModelRunner(ModelRunnerConfig(**values), hf_model=hf_model)


def new_req(request_id: str, prompt: list[int], block_ids: list[int], *, outputs: list[int] | None = None,
            num_computed_tokens: int = 0, **params: Any) -> NewRequestData:
    params.setdefault("temperature", 0.0)
    params.setdefault("seed", 0)
    return NewRequestData(request_id, list(prompt), list(outputs or []), SamplingParams(**params),
                          list(block_ids), num_computed_tokens)


def held(*entries: tuple[str, list[int], int]) -> CachedRequestData:
    """The held requests of a step from ``(request_id, new_block_ids, num_computed_tokens)`` entries."""
    cached = CachedRequestData()
    for request_id, new_block_ids, num_computed_tokens in entries:
        cached.append(request_id, new_block_ids, num_computed_tokens)
    return cached


def step(new: list[NewRequestData] = (), cached: list[tuple[str, list[int], int]] = (), *,
         num_scheduled: dict[str, int], finished: set[str] = frozenset(),
         preempted: set[str] = frozenset()) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=held(*cached), num_scheduled_tokens=dict(num_scheduled),
        total_num_scheduled_tokens=sum(num_scheduled.values()), finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )
