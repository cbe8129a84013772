"""The plain torch references — the oracle of every kernel — against attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_kernels import get_attention_ops
from paged_kernels.reference import ref_paged_attention, ref_reshape_and_cache

pytestmark = pytest.mark.kernel

MIXED = dict(q_lens=[1, 7, 1, 20, 1], seq_lens=[150, 7, 37, 90, 1])
DECODE = dict(q_lens=[1, 1, 1, 1], seq_lens=[150, 37, 1, 64])


def causal_attention_on_contiguous_kv(batch) -> torch.Tensor:
    """Each sequence's K/V copied out position by position, then SDPA with ``is_causal`` over the
    whole sequence (zero queries stand in for the cached positions, whose rows are dropped)."""
    block_size = batch.key_cache.shape[1]
    qsl = batch.query_start_loc.tolist()
    outs = []
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = qsl[s + 1] - qsl[s]
        positions = torch.arange(seq_len)
        blocks = batch.block_tables[s, positions // block_size].long()
        k = batch.key_cache[blocks, positions % block_size].float()  # [seq_len, kv_heads, dim]
        v = batch.value_cache[blocks, positions % block_size].float()
        q = torch.zeros(seq_len, *batch.query.shape[1:])
        q[seq_len - q_len :] = batch.query[qsl[s] : qsl[s + 1]].float()
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=batch.scale,
            enable_gqa=True,
        )
        outs.append(o.transpose(0, 1)[seq_len - q_len :])
    return torch.cat(outs)


@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_major", [False, True], ids=["block-major", "head-major"])
def test_ref_paged_attention_matches_causal_sdpa(paged_batch, shape, gqa, block_size, dtype, head_major):
    batch = paged_batch(
        **shape, num_heads=2 * gqa, num_kv_heads=2, head_dim=32, block_size=block_size, dtype=dtype,
        head_major=head_major,
    )
    assert batch.key_cache.permute(2, 0, 1, 3).is_contiguous() == head_major

    out = ref_paged_attention(*batch.args())

    assert out.dtype == dtype and out.shape == batch.query.shape
    expected = causal_attention_on_contiguous_kv(batch)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_ref_paged_attention_writes_into_out(paged_batch):
    batch = paged_batch(**MIXED)
    out = torch.full_like(batch.query, float("nan"))

    returned = ref_paged_attention(*batch.args(), out=out)

    assert returned is out
    torch.testing.assert_close(out, causal_attention_on_contiguous_kv(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_ref_reshape_and_cache_writes_each_slot_and_skips_minus_one(slot_dtype, storage, empty_cache):
    block_size, num_kv_heads, head_dim = 4, 2, 16  # empty_cache's defaults

    key_cache, value_cache = empty_cache(storage), empty_cache(storage)
    key = torch.randn(5, num_kv_heads, head_dim)
    value = torch.randn(5, num_kv_heads, head_dim)
    slot_mapping = torch.tensor([13, -1, 0, 31, 6], dtype=slot_dtype)

    ref_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(key_cache[slot // block_size, slot % block_size], key[token])
            assert torch.equal(value_cache[slot // block_size, slot % block_size], value[token])
    assert int((key_cache.abs().sum(dim=(2, 3)) != 0).sum()) == 4  # nothing else written


def test_get_attention_ops_selects_backend():
    torch_ops = get_attention_ops("torch")
    assert torch_ops.backend == "torch"
    assert torch_ops.paged_attention is ref_paged_attention
    assert get_attention_ops("auto").backend == ("triton" if torch.cuda.is_available() else "cpu")
    assert get_attention_ops("auto", "cpu").backend == "cpu"
    assert get_attention_ops("auto", "cuda").backend == "triton"
    assert get_attention_ops("cpu").paged_attention.__name__ == "cpu_paged_attention"
    assert get_attention_ops("triton").paged_attention.__name__ == "paged_attention"
    with pytest.raises(ValueError, match="backend"):
        get_attention_ops("cuda")


def test_importing_kernels_does_not_import_triton():
    import subprocess
    import sys

    code = "import sys, paged_kernels, paged_kernels.reference, paged_kernels.cpu; print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
