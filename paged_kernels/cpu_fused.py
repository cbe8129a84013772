"""Fused element-wise ops of a bf16 decoder layer on the CPU, in C (``csrc/cpu_fused_ops.c``).

torch runs a bf16 RMSNorm (after its residual add) or rotary embedding as four to eight separate
ops, each reading and writing a temporary and converting bf16 to fp32 and back: on 2 cores, 0.97 and
1.63 ms per layer for a 2,048-token chunk, 0.30 and 0.22 ms fused (``benchmarks/cpu_kernels.py``). Each function here is one pass,
computed as the torch code of ``worker_service.models.layers`` computes it (fp32 arithmetic, bf16
rounding at the same points), so outputs match it up to fp32 summation order and FMA contraction
(measured: equal in all but a few of 100,000 elements) — not bit-exact, which is why only bf16 models
use them (fp32 keeps Hugging Face's exact op sequence).

:func:`applies` says whether a tensor can take this path (CPU, bf16, the library built); callers
keep their torch code for everything else (CUDA, fp32, no compiler).
"""

from __future__ import annotations

import ctypes

import torch

from paged_kernels import native

_LIBRARY = "cpu_fused_ops"
_P, _I64, _I32, _F32 = native.PTR, native.I64, native.INT, native.FLOAT
_SIGNATURES = {
    "rms_norm_bf16": [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _F32, _I32],
    "rope_bf16": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _I32],
    "silu_mul_bf16": [_P, _I64, _P, _I64, _I64, _I64, _I32],
    "refine_logits_bf16": [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I32, _I32],
    "greedy_refined_bf16": [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I32, _I32],
}


def _entry(symbol: str) -> ctypes._CFuncPtr:
    return native.function(_LIBRARY, symbol, _SIGNATURES[symbol])


def available() -> bool:
    """Whether the fused ops could be built and loaded on this machine."""
    return native.load(_LIBRARY) is not None


def applies(x: torch.Tensor) -> bool:
    """Whether ``x`` (an activation of the layer) goes through the fused ops: a bf16 CPU tensor,
    outside autograd, with the library available."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and available())


def _rows(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * bf16(x / sqrt(mean(x**2) + eps))`` per row of ``x`` ``[T, D]`` (fp32: the residual
    stream), as bf16 ``[T, D]``. With ``residual`` (bf16 ``[T, D]``, a sub-layer's output), ``x +=
    residual`` first, in place — the add and the norm in one pass."""
    if not (_rows(x) and x.dtype == torch.float32 and weight.dtype == torch.bfloat16 and weight.is_contiguous()
            and weight.shape == (x.shape[1],)):
        raise ValueError(f"rms_norm: x must be fp32 rows [T, D], weight contiguous bf16 [D] (got {x.dtype} "
                         f"{tuple(x.shape)}, {weight.dtype} {tuple(weight.shape)})")
    if residual is not None and not (_rows(residual) and residual.dtype == torch.bfloat16 and residual.shape == x.shape):
        raise ValueError(f"rms_norm: residual must be bf16 rows shaped like x (got {residual.dtype} {tuple(residual.shape)})")
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _entry("rms_norm_bf16")(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
        x.shape[0], x.shape[1], float(eps), torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
          positions_checked: bool = False) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, Dh]`` (bf16, each head's ``Dh`` values contiguous; token and head strides
    free, e.g. a view into a fused QKV output) in place by the rows ``positions`` ``[T]`` of the fp32
    tables ``cos``/``sin`` ``[P, Dh]``; returns ``x``. ``positions_checked``: the caller has checked
    every position is in ``[0, P)`` (the model does so once per forward pass, not once per layer)."""
    if not (x.dim() == 3 and x.stride(2) == 1 and x.dtype == torch.bfloat16 and cos.is_contiguous()
            and sin.is_contiguous() and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape
            and cos.shape[1] == x.shape[2] and positions.shape == (x.shape[0],)):
        raise ValueError("rope_: x must be bf16 [T, H, Dh] with contiguous heads, positions [T], "
                         "cos/sin contiguous fp32 [P, Dh]")
    pos = positions.to(torch.int64).contiguous()
    if not positions_checked and pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= cos.shape[0]):
        raise ValueError(f"rope_: positions must lie in [0, {cos.shape[0]})")
    _entry("rope_bf16")(x.data_ptr(), x.stride(0), x.stride(1), x.shape[0], x.shape[1], x.shape[2],
                         pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.stride(0), torch.get_num_threads())
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of a fused gate/up output ``[T, 2I]`` (bf16 rows: gate then up) as a
    new bf16 ``[T, I]``, in one pass (``F.silu`` on the strided half alone costs 2.3x a contiguous one)."""
    if not (_rows(gate_up) and gate_up.dtype == torch.bfloat16 and gate_up.shape[1] % 2 == 0):
        raise ValueError(f"silu_mul: gate_up must be bf16 rows [T, 2I] (got {gate_up.dtype} {tuple(gate_up.shape)})")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=torch.bfloat16)
    _entry("silu_mul_bf16")(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), rows, inter,
                            torch.get_num_threads())
    return out


def _check_lm_head(name: str, logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    if not (_rows(logits) and _rows(hidden) and _rows(weight) and logits.dtype == hidden.dtype == weight.dtype
            == torch.bfloat16 and logits.shape[0] == hidden.shape[0] and logits.shape[1] == weight.shape[0]
            and hidden.shape[1] == weight.shape[1] and 0 <= k <= 64):
        raise ValueError(f"{name}: logits [N, V], hidden [N, D] and weight [V, D] must be bf16 rows, k <= 64 "
                         f"(got {tuple(logits.shape)}, {tuple(hidden.shape)}, {tuple(weight.shape)}, k={k})")


def refine_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits ``[N, V]`` of the LM-head GEMM's bf16 output ``logits`` ``[N, V]``, with the ``k``
    largest of each row (ties to the lower token id) recomputed in fp32 from ``hidden`` ``[N, D]``
    and ``weight`` ``[V, D]`` (bf16 rows): what ``LlamaForCausalLM.compute_logits`` computes with
    torch's ``float``, ``topk``, ``einsum`` and ``scatter_``, in one pass per row. The exact values'
    sums run in a fixed order of their own (not torch's): each row's result is the same in any batch.
    ``out``: where to write them (fp32 ``[N, V]`` rows), e.g. a buffer kept between steps; over
    32 MiB a fresh tensor is a mapping of its own, faulted in page by page at every call."""
    _check_lm_head("refine_logits", logits, hidden, weight, k)
    if out is None:
        out = torch.empty(logits.shape, dtype=torch.float32)
    elif not (_rows(out) and out.dtype == torch.float32 and out.shape == logits.shape):
        raise ValueError(f"refine_logits: out must be fp32 rows of {tuple(logits.shape)} "
                         f"(got {out.dtype} {tuple(out.shape)})")
    _entry("refine_logits_bf16")(
        logits.data_ptr(), logits.stride(0), hidden.data_ptr(), hidden.stride(0), weight.data_ptr(), weight.stride(0),
        out.data_ptr(), out.stride(0), logits.shape[0], logits.shape[1], hidden.shape[1], k, torch.get_num_threads())
    return out


def greedy_refined(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor | None:
    """The greedy token of each row of :func:`refine_logits`' result, as ``int64 [N]``, without making
    that fp32 ``[N, V]`` result: the first index of each row's largest value, which only the ``k``
    exact values and the largest of the rest can be. The same tokens as ``refine_logits(...).max(-1)``
    (the sampler's ``first_argmax``), at the cost of the selection alone. None when a row holds a NaN
    (a logit or an exact value): then take the long way, whose NaN rules are torch's."""
    _check_lm_head("greedy_refined", logits, hidden, weight, k)
    ids = torch.empty(logits.shape[0], dtype=torch.int64)
    _entry("greedy_refined_bf16")(
        logits.data_ptr(), logits.stride(0), hidden.data_ptr(), hidden.stride(0), weight.data_ptr(), weight.stride(0),
        ids.data_ptr(), logits.shape[0], logits.shape[1], hidden.shape[1], k, torch.get_num_threads())
    return None if ids.numel() and bool((ids < 0).any()) else ids
