"""The small-batch bf16 GEMM on AMX tiles (``paged_kernels.small_gemm``) against fp32 sums, its
batch invariance, and the shapes it refuses. The products run where the CPU has AMX-BF16 and Linux
grants the tile registers; the argument checks run everywhere."""

from __future__ import annotations

import pytest
import torch

from paged_kernels import cpu_fused, small_gemm

pytestmark = pytest.mark.kernel

needs_amx = pytest.mark.skipif(not small_gemm.available(), reason="no AMX-BF16 tiles on this CPU")


def _operands(rows: int, out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    w = (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(torch.bfloat16)
    return x, w


def _assert_rounded_fp32_sums(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``y`` is the fp32 product rounded once to bf16: within one bf16 step of it (the sums' order
    moves a value across a rounding boundary at most), and exactly it in nearly every element."""
    exact = x.float() @ w.float().T
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    torch.testing.assert_close(y.float(), exact, rtol=2**-8, atol=1e-6)
    assert (y != exact.to(torch.bfloat16)).float().mean() < 1e-3


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 48, 64, 65, 72, 96, 130, 1000])
@pytest.mark.parametrize("shape", [(16, 32), (48, 64), (960, 576), (576, 1536)],
                         ids=["one-tile", "odd-groups", "qkv", "down"])
def test_products_are_fp32_sums_rounded_once(rows, shape):
    """Row blocks of 16 (whole and partial); as 32 x 32 items at any row count (a last row pair of
    1-32 rows), or as 16-column items in chunks of 64 rows where the columns are an odd number of
    16s; one tile up to a real layer's shapes."""
    x, w = _operands(rows, *shape)
    _assert_rounded_fp32_sums(small_gemm.linear(x, small_gemm.pack(w), shape[0]), x, w)


@needs_amx
@pytest.mark.parametrize("rows", [3, 70, 100])
@pytest.mark.parametrize("out_features", [48, 64])
def test_a_bias_is_added_to_the_fp32_sums(rows, out_features):
    x, w = _operands(rows, out_features, 64, seed=2)
    bias = torch.randn(out_features).to(torch.bfloat16)
    y = small_gemm.linear(x, small_gemm.pack(w), out_features, bias)
    exact = x.float() @ w.float().T + bias.float()
    torch.testing.assert_close(y.float(), exact, rtol=2**-8, atol=1e-6)
    assert torch.equal(y[-1], small_gemm.linear(x[-1:], small_gemm.pack(w), out_features, bias)[0])


@needs_amx
def test_rows_of_a_strided_view():
    """x may be a view with a wider row stride (e.g. part of a fused projection's output)."""
    x, w = _operands(5, 48, 64)
    wide = torch.zeros(5, 160, dtype=torch.bfloat16)
    wide[:, 40:104] = x
    view = wide[:, 40:104]
    assert not view.is_contiguous()
    assert torch.equal(small_gemm.linear(view, small_gemm.pack(w), 48), small_gemm.linear(x, small_gemm.pack(w), 48))


@needs_amx
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (48, 64)], ids=["32x32-items", "16-column-items"])
def test_each_row_is_the_same_alone_and_in_any_batch(out_features, in_features):
    """Across row blocks, row pairs and chunks of 64 rows, for both kinds of work item: one row
    alone and in any batch — the same chain of tile products for each output."""
    x, w = _operands(200, out_features, in_features, seed=4)
    packed = small_gemm.pack(w)
    together = small_gemm.linear(x, packed, out_features)
    for lo, hi in [(0, 1), (16, 17), (63, 64), (64, 70), (5, 40), (30, 100), (0, 65), (199, 200), (100, 200)]:
        assert torch.equal(small_gemm.linear(x[lo:hi], packed, out_features), together[lo:hi]), (lo, hi)


@needs_amx
def test_special_values_pass_through():
    """Infinities and NaN propagate as in any fp32 sum; zeros give zeros."""
    x, w = _operands(3, 32, 64)
    x[0] = 0
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    w = w.abs() + 0.01  # every product with the infinity is +inf
    y = small_gemm.linear(x, small_gemm.pack(w), 32)
    assert torch.equal(y[0], torch.zeros(32, dtype=torch.bfloat16))
    assert torch.isinf(y[1]).all() and (y[1] > 0).all()
    assert torch.isnan(y[2]).all()


@pytest.mark.parametrize("weight", [
    torch.zeros(24, 64, dtype=torch.bfloat16),  # columns not a multiple of 16
    torch.zeros(32, 48, dtype=torch.bfloat16),  # inputs not a multiple of 32
    torch.zeros(32, 64, dtype=torch.float32),  # not bf16
    torch.zeros(64, 32, dtype=torch.bfloat16).t(),  # not rows
], ids=["columns", "inputs", "dtype", "transposed"])
def test_weights_it_cannot_lay_out_are_refused(weight):
    assert not small_gemm.packable(weight)
    with pytest.raises(ValueError, match="small_gemm.pack"):
        small_gemm.pack(weight)


def test_the_row_limit_follows_the_work_items():
    assert small_gemm.max_rows(960) == small_gemm.MAX_ROWS  # 32-column items
    assert small_gemm.max_rows(48) == small_gemm.MAX_ROWS_NARROW  # 16-column items only


def test_inputs_that_do_not_match_the_weight_are_refused():
    packed = torch.zeros(32 * 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="small_gemm.linear"):
        small_gemm.linear(torch.zeros(2, 48, dtype=torch.bfloat16), packed, 32)  # 48 inputs, not 64
    with pytest.raises(ValueError, match="small_gemm.linear"):
        small_gemm.linear(torch.zeros(2, 64, dtype=torch.float32), packed, 32)
    with pytest.raises(ValueError, match="small_gemm.linear"):
        small_gemm.linear(torch.zeros(0, 64, dtype=torch.bfloat16), packed, 32)
    with pytest.raises(ValueError, match="bias"):
        small_gemm.linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, 32, torch.zeros(16, dtype=torch.bfloat16))


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 64, 100, 1000])
@pytest.mark.parametrize("intermediate, in_features", [(16, 32), (48, 64), (1536, 576)],
                         ids=["one-group", "odd-groups", "smollm2"])
def test_silu_mul_gives_the_bits_of_silu_mul_after_the_gemm(rows, intermediate, in_features):
    """The gate/up layout's one pass: SiLU(gate) * up exactly as cpu_fused.silu_mul computes it
    from the plain GEMM's bf16 output (bit patterns compared, signed zeros included)."""
    x, w = _operands(rows, 2 * intermediate, in_features, seed=5)
    x = x * 4  # gate values well into SiLU's curved part, both signs
    plain = cpu_fused.silu_mul(small_gemm.linear(x, small_gemm.pack(w), 2 * intermediate))
    fused = small_gemm.silu_mul_linear(x, small_gemm.pack_gate_up(w), intermediate)
    assert fused.shape == (rows, intermediate) and fused.dtype == torch.bfloat16
    assert torch.equal(fused.view(torch.int16), plain.view(torch.int16))


@needs_amx
def test_silu_mul_of_each_row_is_the_same_alone_and_in_any_batch():
    x, w = _operands(150, 96, 64, seed=6)
    packed = small_gemm.pack_gate_up(w)
    together = small_gemm.silu_mul_linear(x, packed, 48)
    for lo, hi in [(0, 1), (16, 17), (5, 40), (30, 100), (149, 150)]:
        assert torch.equal(small_gemm.silu_mul_linear(x[lo:hi], packed, 48), together[lo:hi]), (lo, hi)


def test_a_gate_up_weight_needs_whole_groups_in_each_half():
    with pytest.raises(ValueError, match="pack_gate_up"):
        small_gemm.pack_gate_up(torch.zeros(48, 64, dtype=torch.bfloat16))  # halves of 24 rows
    with pytest.raises(ValueError, match="silu_mul_linear"):
        small_gemm.silu_mul_linear(torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(32 * 64, dtype=torch.bfloat16), 16)
