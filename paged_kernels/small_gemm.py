"""A bf16 linear layer on AMX tiles for decode steps and short prefills (``csrc/small_gemm_bf16.c``).

Below ~1,000 rows oneDNN's GEMM runs well under the tiles' rate, and at 1-64 rows its calls cost
far more than reading the weight: a SmolLM2-135M decode step of one token spends ~13 ms in its 120
decoder-layer GEMMs, ~8.5 ms of which reading the weights from memory needs. This kernel reads
each weight laid out at load as the B tiles of the tile product (:func:`pack`: a second copy of
the weight), and x as it is. Measured on a 2-core AMX host, SmolLM2-135M's 120 layer GEMMs
(``python benchmarks/cpu_kernels.py --part gemm``): see benchmarks/README.md, "CPU kernels".

Each row's result depends on that row alone (the same in any batch); it differs from oneDNN's
(``F.linear``) only in the order of the fp32 sums, in a few elements per hundred thousand by one
bf16 step. Only where the CPU has AMX-BF16 and Linux grants the tile registers (:func:`available`);
callers keep oneDNN elsewhere, and above :func:`max_rows` rows, where oneDNN is faster.
"""

from __future__ import annotations

import ctypes

import torch

from paged_kernels import native

_LIBRARY = "small_gemm_bf16"
_P, _I64, _I32 = native.PTR, native.I64, native.INT
GROUP, K_BLOCK = 16, 32  # output columns per packed group, inputs per tile
# Rows up to which the kernel beats oneDNN (2-core AMX host, a step's 120 GEMMs of SmolLM2-135M,
# cpu_kernels.py --part gemm): with 32 rows x 32 columns a work item (out_features a multiple of
# 32) up to ~1,000 (1,024 rows: 122.0 vs 144.4 ms; 2,048: 326.6 vs 203.8); with 16-column items
# alone, up to 64 (64 rows: 17.3 vs 17.9; 128: 28.3 vs 24.9).
MAX_ROWS, MAX_ROWS_NARROW = 1024, 64


def max_rows(out_features: int) -> int:
    """The most rows worth running here for a weight of ``out_features`` outputs."""
    return MAX_ROWS if out_features % 32 == 0 else MAX_ROWS_NARROW


def available() -> bool:
    """Whether the kernel runs here: built, with AMX-BF16 and the tile registers granted."""
    fn = native.function(_LIBRARY, "small_gemm_bf16_available", [], ctypes.c_int)
    return fn is not None and fn() == 1


def packable(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` takes ``weight``: bf16 rows ``[out, in]``, ``out`` a multiple of 16 and
    ``in`` of 32."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.stride(1) == 1 and weight.shape[0] % GROUP == 0 and weight.shape[1] % K_BLOCK == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (bf16 rows) laid out as the kernel's B tiles: a new flat tensor of
    ``out * in`` values (per 16 output columns, their input pairs line by line)."""
    if not packable(weight):
        raise ValueError(f"small_gemm.pack: weight must be bf16 rows [out, in] with out % {GROUP} == 0 and "
                         f"in % {K_BLOCK} == 0 (got {weight.dtype} {tuple(weight.shape)})")
    packed = torch.empty(weight.numel(), dtype=torch.bfloat16)
    fn = native.function(_LIBRARY, "small_gemm_pack_bf16", [_P, _I64, _P, _I64, _I64])
    if fn is None:
        raise RuntimeError("the small-GEMM kernel could not be built here")
    fn(weight.data_ptr(), weight.stride(0), packed.data_ptr(), weight.shape[0], weight.shape[1])
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` as bf16 ``[rows, out_features]`` for ``x`` bf16 rows ``[rows, in]`` (any
    row stride), ``W`` packed by :func:`pack`, ``bias`` bf16 ``[out_features]`` or None (added to
    the fp32 sums before rounding); ``1 <= rows``, best up to :func:`max_rows`."""
    rows, in_features = x.shape
    if not (x.dtype == torch.bfloat16 and x.stride(1) == 1 and packed.numel() == out_features * in_features
            and rows >= 1):
        raise ValueError(f"small_gemm.linear: x must be bf16 rows [rows >= 1, {packed.numel() // max(out_features, 1)}] "
                         f"(got {x.dtype} {tuple(x.shape)})")
    if bias is not None and not (bias.dtype == torch.bfloat16 and bias.shape == (out_features,) and bias.is_contiguous()):
        raise ValueError(f"small_gemm.linear: bias must be contiguous bf16 [{out_features}] "
                         f"(got {bias.dtype} {tuple(bias.shape)})")
    y = torch.empty((rows, out_features), dtype=torch.bfloat16)
    fn = native.function(_LIBRARY, "small_gemm_bf16", [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I32],
                         ctypes.c_int)
    if fn is None or fn(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                        y.data_ptr(), y.stride(0), rows, out_features, in_features, torch.get_num_threads()) != 0:
        raise RuntimeError("the small-GEMM kernel cannot run here (see small_gemm.available)")
    return y


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """A fused gate/up weight ``[2I, in]`` (gate rows, then up rows; bf16, ``I`` a multiple of 16)
    laid out for :func:`silu_mul_linear`: :func:`pack` of its 16-row groups interleaved (gate group
    j, then up group j), so that one work item of 32 columns holds the gate and the up of the same
    16 outputs."""
    if not (packable(weight) and weight.shape[0] % (2 * GROUP) == 0):
        raise ValueError(f"small_gemm.pack_gate_up: weight must be bf16 rows [2I, in] with I % {GROUP} == 0 and "
                         f"in % {K_BLOCK} == 0 (got {weight.dtype} {tuple(weight.shape)})")
    out2, in_features = weight.shape
    groups = weight.reshape(2, out2 // (2 * GROUP), GROUP, in_features)  # [gate|up, group, 16, in]
    return pack(groups.transpose(0, 1).reshape(out2, in_features))


def silu_mul_linear(x: torch.Tensor, packed: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``silu(gate) * up`` as bf16 ``[rows, intermediate]``, ``gate`` and ``up`` the two halves of ``x @
    W.T`` for ``x`` bf16 rows ``[rows, in]`` and the fused weight ``W`` ``[2 * intermediate, in]``
    packed by :func:`pack_gate_up`: the same bits as ``cpu_fused.silu_mul(linear(x, pack(W), 2 *
    intermediate))``, in one pass that never writes the ``[rows, 2 * intermediate]`` product."""
    rows, in_features = x.shape
    if not (x.dtype == torch.bfloat16 and x.stride(1) == 1 and packed.numel() == 2 * intermediate * in_features
            and rows >= 1):
        raise ValueError(f"small_gemm.silu_mul_linear: x must be bf16 rows [rows >= 1, "
                         f"{packed.numel() // max(2 * intermediate, 1)}] (got {x.dtype} {tuple(x.shape)})")
    y = torch.empty((rows, intermediate), dtype=torch.bfloat16)
    fn = native.function(_LIBRARY, "small_gemm_silu_mul_bf16", [_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I32],
                         ctypes.c_int)
    if fn is None or fn(x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), y.stride(0), rows, intermediate,
                        in_features, torch.get_num_threads()) != 0:
        raise RuntimeError("the small-GEMM kernel cannot run here (see small_gemm.available)")
    return y
