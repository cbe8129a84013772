"""The fused bf16 element-wise ops (``paged_kernels.cpu_fused``, C) against the model's torch code, and the
model's choice between them."""

from __future__ import annotations

import pytest
import torch

from paged_kernels import cpu_fused, native
from worker_service.models.layers import RMSNorm, RotaryEmbedding, apply_rope, rope_inv_freq
from worker_service.models.llama import MLP

needs_native = pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler on this machine")

D, HEADS, KV_HEADS, HEAD_DIM = 96, 6, 2, 32


def bf16_norm(seed: int = 0) -> RMSNorm:
    norm = RMSNorm(D, 1e-5)
    norm.weight.data = torch.randn(D, generator=torch.Generator().manual_seed(seed))
    return norm.to(torch.bfloat16)


@pytest.fixture(autouse=True)
def _same_inputs_whatever_ran_before():
    """Inputs drawn from torch's global generator are the same in any test order: with one row, a
    single last-bit difference is already 0.4 % of the elements."""
    torch.manual_seed(0)


def torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm.forward's torch code, whatever path the module would take."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(norm.weight.dtype)


def assert_nearly_equal(expected: torch.Tensor, got: torch.Tensor) -> None:
    """Equal but for rare last-bit differences of a bf16 rounding (fp32 summation order, FMA)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    differ = (got.float() != expected.float()).float().mean().item()
    assert differ < 1e-3, f"{differ:.2%} of elements differ"
    torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=2 ** -7)  # one bf16 step


@needs_native
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 96 elements: the multi-threaded path
def test_rms_norm_matches_the_torch_code(rows):
    norm = bf16_norm()
    x = torch.randn(rows, D) * 4

    assert_nearly_equal(torch_norm(norm, x), cpu_fused.rms_norm(x, norm.weight, norm.eps))


@needs_native
@pytest.mark.parametrize("rows", [1, 300])
def test_add_and_norm_updates_the_residual_stream_in_place(rows):
    norm = bf16_norm(1)
    x = torch.randn(rows, D) * 4
    y = torch.randn(rows, D).to(torch.bfloat16)
    expected_x = x + y

    out = cpu_fused.rms_norm(x, norm.weight, norm.eps, residual=y)

    assert torch.equal(x, expected_x)  # fp32 + widened bf16: exact
    assert_nearly_equal(torch_norm(norm, expected_x), out)


@needs_native
def test_rms_norm_reads_strided_rows():
    norm = bf16_norm(2)
    wide = torch.randn(5, 2 * D)
    rows = wide[:, D:]  # a row stride of 2D

    assert_nearly_equal(torch_norm(norm, rows.contiguous()), cpu_fused.rms_norm(rows, norm.weight, norm.eps))


@needs_native
@pytest.mark.parametrize("tokens", [1, 5, 200])
def test_rope_rotates_q_and_k_heads_of_a_fused_qkv_in_place(tokens):
    rope = RotaryEmbedding(torch.arange(0, HEAD_DIM, 2).float().div(HEAD_DIM).mul(-9.2).exp(), 512)
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(tokens))
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(torch.bfloat16)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM)  # strided view
    v_before = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].clone()
    expected = apply_rope(qk, rope.cos[positions][:, None], rope.sin[positions][:, None])

    got = cpu_fused.rope_(qk, positions, rope.cos, rope.sin)

    assert got.data_ptr() == qk.data_ptr()  # in place
    assert_nearly_equal(expected, got)
    assert torch.equal(qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:], v_before)  # V untouched


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[1] // 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@needs_native
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 200 elements: the multi-threaded path
@pytest.mark.parametrize("inter", [200, 17, 1536])  # whole 16-lane vectors, a tail only, SmolLM2's width
def test_silu_mul_matches_the_torch_code(rows, inter):
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 4).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([float("inf"), -float("inf"), 90.0, -90.0])  # saturated and vanishing gates
    expected = torch_silu_mul(gate_up)
    got = cpu_fused.silu_mul(gate_up)
    nan = expected.isnan()  # silu(-inf) = -inf / inf, in torch too
    assert torch.equal(got.isnan(), nan) and nan.any()
    expected, got = expected.masked_fill(nan, 0), got.masked_fill(nan, 0)
    assert_nearly_equal(expected, got)
    print(f"{rows}x{inter}: {(got != expected).sum().item()} of {got.numel()} differ")  # 0 here (bit-equal)


@needs_native
@pytest.mark.parametrize("extra", [(), ("-mno-avx512bf16",), ("-mno-avx512f",)],
                         ids=["this-build", "avx512-without-bf16", "plain-c-build"])
def test_silu_mul_and_rms_norm_plain_c_loops_match_too(monkeypatch, tmp_path, extra):
    """The AVX-512 loops (rounding by the AVX512-BF16 instruction or without it) and the plain C loops
    (a CPU without AVX-512) agree with torch."""
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + extra)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    gate_up = (torch.randn(33, 2 * 100) * 3).to(torch.bfloat16)
    assert_nearly_equal(torch_silu_mul(gate_up), cpu_fused.silu_mul(gate_up))
    norm, x, y = bf16_norm(1), torch.randn(33, D), torch.randn(33, D).to(torch.bfloat16)
    expected = torch_norm(norm, x + y.float())
    got = cpu_fused.rms_norm(x, norm.weight, norm.eps, residual=y)
    assert_nearly_equal(expected, got)
    assert [p.name for p in tmp_path.iterdir()][0].startswith("cpu_fused_ops-")  # built with `extra`


def torch_refined_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    """compute_logits' torch code: the k largest of each row recomputed in fp32."""
    out = logits.float()
    top = out.topk(k, dim=-1).indices
    out.scatter_(1, top, torch.einsum("nd,nkd->nk", hidden.float(), weight[top].float()))
    return out


def lm_head(rows: int, vocab: int = 3000, dim: int = 96, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, dim, generator=gen) * 0.1).to(torch.bfloat16)
    hidden = torch.randn(rows, dim, generator=gen).to(torch.bfloat16)
    return hidden, weight, torch.nn.functional.linear(hidden, weight)


@needs_native
@pytest.mark.parametrize("rows", [1, 7, 64])  # 64 x 3,000: the multi-threaded path
def test_refined_logits_match_the_torch_code(rows):
    hidden, weight, logits = lm_head(rows)
    got = cpu_fused.refine_logits(logits, hidden, weight, 8)
    expected = torch_refined_logits(logits, hidden, weight, 8)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert ((got != logits.float()).sum(dim=1) <= 8).all()
    # The sets refined may differ only among values tied with the 8th largest (torch's topk picks
    # any of them, the kernel the lowest ids); where both refined, the sums agree.
    kth = logits.float().topk(8, dim=-1).values[:, -1:]
    differ = ~torch.isclose(got, expected, atol=1e-5, rtol=1e-5)
    assert (logits.float()[differ] == kth.expand_as(logits)[differ]).all()
    assert differ.sum() <= rows * 8
    assert torch.equal(got.argmax(dim=-1), expected.argmax(dim=-1))
    # exactly: the 8 largest bf16 values (ties to the lower id) take the fp32 product, the rest stay
    top = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :8]
    exact = hidden.float() @ weight.float().T
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), atol=1e-5, rtol=1e-5)
    kept = torch.ones_like(got, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(got[kept], logits.float()[kept])


@needs_native
def test_refined_logits_break_ties_toward_the_lower_token_id_and_ignore_the_batch():
    hidden, weight, _ = lm_head(5, vocab=40)
    logits = torch.zeros(5, 40, dtype=torch.bfloat16)  # every value tied: the first k ids are refined
    logits[:, 30] = 1.0  # ... after the one larger value
    got = cpu_fused.refine_logits(logits, hidden, weight, 4)
    exact = hidden.float() @ weight.float().T
    for row in range(5):
        refined = (got[row] != logits[row].float()).nonzero().flatten().tolist()
        assert set(refined) <= {0, 1, 2, 30}
        torch.testing.assert_close(got[row, [0, 1, 2, 30]], exact[row, [0, 1, 2, 30]], atol=1e-5, rtol=1e-5)
    hidden, weight, logits = lm_head(9, seed=1)
    alone = torch.cat([cpu_fused.refine_logits(logits[i:i + 1], hidden[i:i + 1], weight, 8) for i in range(9)])
    assert torch.equal(alone, cpu_fused.refine_logits(logits, hidden, weight, 8))


@needs_native
def test_refined_logits_go_into_a_given_buffer():
    hidden, weight, logits = lm_head(7)
    buffer = torch.full((16, logits.shape[1]), float("nan"))
    got = cpu_fused.refine_logits(logits, hidden, weight, 8, out=buffer[:7])
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, cpu_fused.refine_logits(logits, hidden, weight, 8))
    assert buffer[7:].isnan().all()  # rows past the step's are not touched


@needs_native
@pytest.mark.parametrize("k", [0, 1, 8, 64])
@pytest.mark.parametrize("vocab", [5, 9, 3000])  # fewer tokens than k + 1, then many
def test_greedy_refined_takes_the_token_the_refined_row_gives(k, vocab):
    from worker_service.sampler import first_argmax

    for seed in range(4):
        hidden, weight, logits = lm_head(33, vocab=vocab, seed=seed)
        if seed == 1:  # coarse logits: ties and near-ties at the top everywhere
            hidden = (hidden * 8).to(torch.bfloat16)
            logits = torch.nn.functional.linear(hidden, weight)
        if seed == 2:  # pairs of equal weight rows: equal bf16 logits, equal exact sums, ids apart
            weight[1::2] = weight[0::2][: weight[1::2].shape[0]]
            logits = torch.nn.functional.linear(hidden, weight)
        expected = first_argmax(cpu_fused.refine_logits(logits, hidden, weight, k))
        got = cpu_fused.greedy_refined(logits, hidden, weight, k)
        assert got.dtype == torch.int64 and torch.equal(got, expected), (seed, got, expected)


@needs_native
def test_greedy_refined_picks_the_largest_of_the_rest_when_every_exact_value_falls_below_it():
    # every logit equal in bf16 (1.0), the exact sums of the refined ids a little less: the first
    # unrefined id (k) holds the row's largest value, 1.0
    hidden = torch.ones(1, 64, dtype=torch.bfloat16)
    weight = torch.full((10, 64), 1 / 64, dtype=torch.bfloat16)
    weight[:, 0] = 1 / 64 - 1 / 2048  # exact sums 1 - 1/2048: rounded to 1.0 in bf16
    logits = torch.nn.functional.linear(hidden, weight)
    assert (logits == 1.0).all()
    refined = cpu_fused.refine_logits(logits, hidden, weight, 4)
    assert (refined[0, :4] < 1.0).all() and (refined[0, 4:] == 1.0).all()
    assert cpu_fused.greedy_refined(logits, hidden, weight, 4).tolist() == [4]


@needs_native
def test_greedy_refined_leaves_rows_holding_a_nan_to_the_long_way():
    hidden, weight, logits = lm_head(3)
    assert cpu_fused.greedy_refined(logits, hidden, weight, 8) is not None
    logits[1, 17] = float("nan")
    assert cpu_fused.greedy_refined(logits, hidden, weight, 8) is None
    hidden, weight, logits = lm_head(3)
    hidden[2, :2] = torch.tensor([float("inf"), float("-inf")])  # its exact sums: inf - inf, NaN
    weight[:, :2] = 1.0
    assert cpu_fused.greedy_refined(logits, hidden, weight, 8) is None


@needs_native
def test_bad_arguments_are_refused_by_name():
    norm = bf16_norm()
    with pytest.raises(ValueError, match="rms_norm: x must be fp32"):
        cpu_fused.rms_norm(torch.randn(2, D).to(torch.bfloat16), norm.weight, 1e-5)
    with pytest.raises(ValueError, match=r"weight contiguous bf16 \[D\]"):
        cpu_fused.rms_norm(torch.randn(2, D + 1), norm.weight, 1e-5)  # a weight shorter than the row
    with pytest.raises(ValueError, match="residual"):
        cpu_fused.rms_norm(torch.randn(2, D), norm.weight, 1e-5, residual=torch.randn(3, D).to(torch.bfloat16))
    table = torch.zeros(8, HEAD_DIM)
    x = torch.zeros(2, 1, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 8\)"):
        cpu_fused.rope_(x, torch.tensor([0, 8]), table, table)
    with pytest.raises(ValueError, match="rope_: x must be bf16"):
        cpu_fused.rope_(x.float(), torch.tensor([0, 1]), table, table)
    with pytest.raises(ValueError, match=r"silu_mul: gate_up must be bf16 rows \[T, 2I\]"):
        cpu_fused.silu_mul(torch.randn(2, 8))
    with pytest.raises(ValueError, match="silu_mul"):
        cpu_fused.silu_mul(torch.randn(2, 7).to(torch.bfloat16))  # no even split into gate and up
    hidden, weight, logits = lm_head(2)
    with pytest.raises(ValueError, match=r"refine_logits: logits \[N, V\]"):
        cpu_fused.refine_logits(logits.float(), hidden, weight, 8)
    with pytest.raises(ValueError, match="refine_logits"):
        cpu_fused.refine_logits(logits, hidden[:, :10], weight, 8)
    with pytest.raises(ValueError, match="refine_logits: out must be fp32 rows"):
        cpu_fused.refine_logits(logits, hidden, weight, 8, out=torch.empty(3, logits.shape[1]))
    with pytest.raises(ValueError, match=r"greedy_refined: logits \[N, V\]"):
        cpu_fused.greedy_refined(logits.float(), hidden, weight, 8)
    with pytest.raises(ValueError, match="greedy_refined"):
        cpu_fused.greedy_refined(logits, hidden, weight, 65)


def test_only_bf16_cpu_tensors_outside_autograd_take_the_fused_path(monkeypatch):
    bf16 = torch.zeros(2, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_fused, "available", lambda: True)
    assert not cpu_fused.applies(torch.zeros(2))  # fp32 keeps Hugging Face's exact op sequence
    assert not cpu_fused.applies(torch.zeros(2, dtype=torch.float16))
    with torch.enable_grad():
        assert not cpu_fused.applies(bf16)
    with torch.no_grad():
        assert cpu_fused.applies(bf16)
    monkeypatch.setattr(cpu_fused, "available", lambda: False)
    with torch.no_grad():
        assert not cpu_fused.applies(bf16)


def test_without_the_library_the_model_layers_use_torch(monkeypatch):
    monkeypatch.setattr(native, "_loaded", {"cpu_fused_ops": None})  # as if the build had failed
    norm = bf16_norm(3)
    x, y = torch.randn(4, D), torch.randn(4, D).to(torch.bfloat16)
    rope = RotaryEmbedding(rope_inv_freq(type("Cfg", (), {"rope_theta": 10000.0})(), HEAD_DIM), 64)
    positions = torch.tensor([0, 5, 9, 63])
    qk = torch.randn(4, HEADS, HEAD_DIM).to(torch.bfloat16)

    with torch.no_grad():
        assert not cpu_fused.applies(norm.weight)
        new_x, h = norm.add_and_norm(x, y)
        rotated = rope(positions)(qk)

    assert torch.equal(new_x, x + y) and not torch.equal(new_x, x)  # out of place on this path
    assert torch.equal(h, torch_norm(norm, x + y))
    assert torch.equal(rotated, apply_rope(qk, rope.cos[positions][:, None], rope.sin[positions][:, None]))
    assert rotated.data_ptr() != qk.data_ptr()


@needs_native
def test_the_model_layers_take_the_fused_path_for_bf16(monkeypatch):
    calls = []
    for name in ("rms_norm", "rope_", "silu_mul"):
        original = getattr(cpu_fused, name)
        monkeypatch.setattr(cpu_fused, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    norm = bf16_norm(4)
    rope = RotaryEmbedding(rope_inv_freq(type("Cfg", (), {"rope_theta": 10000.0})(), HEAD_DIM), 64)
    x, y = torch.randn(3, D), torch.randn(3, D).to(torch.bfloat16)

    mlp = MLP(type("Cfg", (), {"hidden_size": D, "intermediate_size": 40})())
    h = torch.randn(3, D)

    with torch.no_grad():
        norm(x)
        norm.add_and_norm(x, y)
        rope(torch.tensor([1, 2, 3]))(torch.randn(3, HEADS, HEAD_DIM).to(torch.bfloat16))
        fused = mlp.to(torch.bfloat16)(h.to(torch.bfloat16))
        expected = mlp.down(torch_silu_mul(mlp.gate_up(h.to(torch.bfloat16))))
        norm.float()(x)  # an fp32 model: torch
        rope(torch.tensor([1, 2, 3]))(torch.randn(3, HEADS, HEAD_DIM))
        mlp.float()(h)

    assert calls == ["rms_norm", "rms_norm", "rope_", "silu_mul"]
    assert_nearly_equal(expected, fused)


def test_positions_past_the_rotary_tables_are_refused():
    rope = RotaryEmbedding(torch.ones(HEAD_DIM // 2), 16)
    with pytest.raises(IndexError, match=r"positions must lie in \[0, 16\)"):
        rope(torch.tensor([3, 16]))
    with pytest.raises(IndexError):
        rope(torch.tensor([-1]))

