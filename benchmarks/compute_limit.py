"""The compute limit of an offline run: its workload's FLOPs ÷ the GEMM rate this machine reaches.

A throughput figure alone does not say how far from the hardware it is. This module counts the
matmul FLOPs a workload needs (the decoder's linear layers for every token that goes through the
model, the attention score and value products for every (query, key) pair, the LM head for every
sampled token) and measures, at the start of the run and in the dtype it runs, the rate torch's CPU
GEMM reaches on the model's own layer shapes. Their quotient is the fastest the run could possibly
be if every FLOP ran at GEMM speed and nothing else took time; ``share`` is how much of it we use.

    python benchmarks/compute_limit.py --dtype bfloat16     # the GEMM rate alone
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class WorkloadFlops:
    linear: float  # the decoder layers' projections, every token through the model
    attention: float  # Q·K and P·V over each token's causal context
    lm_head: float  # one logits row per sampled token

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.lm_head


def layer_shapes(cfg: Any) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's GEMMs as the model runs them (QKV and
    gate/up fused); ``cfg`` is a ``worker_service.models.llama.DecoderConfig``."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(cfg.hidden_size, q + 2 * kv), (q, cfg.hidden_size),
            (cfg.hidden_size, 2 * cfg.intermediate_size), (cfg.intermediate_size, cfg.hidden_size)]


def workload_flops(cfg: Any, requests: Sequence[tuple[int, int]]) -> WorkloadFlops:
    """FLOPs of generating ``requests`` = [(prompt_len, output_len)]: each prompt token and each
    output token but the last goes through the model once; each output token is one LM-head row."""
    params = cfg.num_layers * sum(i * o for i, o in layer_shapes(cfg))
    tokens = sum(p + n - 1 for p, n in requests)
    # the causal context of the token at position i (0-based) is i + 1 keys
    pairs = sum((p + n - 1) * (p + n) // 2 for p, n in requests)
    per_pair = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # Q·K and P·V, 2 FLOPs per MAC
    return WorkloadFlops(linear=2.0 * params * tokens, attention=float(per_pair * pairs),
                         lm_head=2.0 * cfg.hidden_size * cfg.vocab_size * sum(n for _, n in requests))


def gemm_rate(cfg: Any, dtype: torch.dtype, *, tokens: int = 512, seconds: float = 1.0) -> float:
    """FLOP/s of torch's GEMM on one decoder layer's shapes (``tokens`` rows, ``dtype``), on this
    machine now: the layers' four GEMMs in turn, repeated for about ``seconds`` after a warm-up."""
    with torch.inference_mode():
        x = {i: torch.randn(tokens, i).to(dtype) for i, _ in layer_shapes(cfg)}
        w = [torch.randn(o, i).to(dtype) / i**0.5 for i, o in layer_shapes(cfg)]
        flops = 2.0 * tokens * sum(i * o for i, o in layer_shapes(cfg))

        def one_layer() -> None:
            for weight in w:
                F.linear(x[weight.shape[1]], weight)

        for _ in range(2):
            one_layer()
        rounds, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or rounds < 3:
            one_layer()
            rounds += 1
    return flops * rounds / elapsed


def compute_limit(cfg: Any, requests: Sequence[tuple[int, int]], rate: float, output_tokens_per_s: float) -> dict:
    """The run's compute limit (output tok/s if every FLOP ran at ``rate``) and our share of it."""
    flops = workload_flops(cfg, requests)
    output_tokens = sum(n for _, n in requests)
    limit = output_tokens / (flops.total / rate)
    return {
        "gemm_gflops_per_s": round(rate / 1e9, 1),
        "workload_tflop": round(flops.total / 1e12, 3),
        "workload_tflop_parts": {k: round(v / 1e12, 3) for k, v in asdict(flops).items()},
        "limit_output_tokens_per_s": round(limit, 1),
        "share_of_limit": round(output_tokens_per_s / limit, 4),
    }


def describe(limit: dict, dtype: str) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in limit["workload_tflop_parts"].items())
    return (f"compute limit ({dtype}): workload {limit['workload_tflop']} TFLOP ({parts}) at "
            f"{limit['gemm_gflops_per_s']} GFLOP/s GEMM = {limit['limit_output_tokens_per_s']} output tok/s; "
            f"we reach {100 * limit['share_of_limit']:.1f} % of it")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seconds", type=float, default=1.0)
    args = p.parse_args(argv)
    from servicekit.model_registry import resolve_model
    from worker_service.loader import choose_dtype, load_hf_config
    from worker_service.models import model_class_for

    hf_config = load_hf_config(resolve_model(args.model))
    cfg = model_class_for(hf_config).config_from_hf(hf_config)
    choice = choose_dtype(args.dtype, torch.device("cpu"), hf_config)
    rate = gemm_rate(cfg, choice.dtype, seconds=args.seconds)
    print(f"{choice.name} ({choice.reason}): {rate / 1e9:.1f} GFLOP/s on {args.model}'s layer GEMMs, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
