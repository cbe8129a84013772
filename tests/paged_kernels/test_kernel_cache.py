"""Triton ``reshape_and_cache`` against its reference (interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from paged_kernels.cache import reshape_and_cache
from paged_kernels.reference import ref_reshape_and_cache

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_step(num_tokens, num_kv_heads, head_dim, block_size, dtype, slot_dtype, num_blocks=64):
    """New K/V for ``num_tokens`` tokens, random distinct slots (some ``-1``), random caches."""
    gen = torch.Generator().manual_seed(0)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding tokens
    tensors = dict(
        key=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen),
        value=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen),
        key_cache=torch.randn(cache_shape, generator=gen),
        value_cache=torch.randn(cache_shape, generator=gen),
    )
    tensors = {name: t.to(dtype=dtype, device=DEVICE) for name, t in tensors.items()}
    tensors["slot_mapping"] = slots.to(dtype=slot_dtype, device=DEVICE)
    return tensors


@pytest.mark.parametrize(
    "num_kv_heads, head_dim, block_size, dtype, slot_dtype",
    [
        (1, 16, 4, torch.float32, torch.int64),
        (3, 64, 16, torch.float16, torch.int32),
        (2, 80, 16, torch.bfloat16, torch.int64),  # head_dim and heads not powers of two
        (3, 16, 4, torch.bfloat16, torch.int32),
    ],
)
def test_reshape_and_cache_matches_reference(num_kv_heads, head_dim, block_size, dtype, slot_dtype):
    step = make_step(10, num_kv_heads, head_dim, block_size, dtype, slot_dtype)
    expected_k, expected_v = step["key_cache"].clone(), step["value_cache"].clone()
    ref_reshape_and_cache(step["key"], step["value"], expected_k, expected_v, step["slot_mapping"])

    reshape_and_cache(**step)

    assert torch.equal(step["key_cache"], expected_k)  # a copy: bit-exact
    assert torch.equal(step["value_cache"], expected_v)


def test_reshape_and_cache_leaves_cache_untouched_for_minus_one_slots():
    step = make_step(4, 2, 16, 4, torch.float32, torch.int64)
    step["slot_mapping"].fill_(-1)
    before = step["key_cache"].clone(), step["value_cache"].clone()

    reshape_and_cache(**step)

    assert torch.equal(step["key_cache"], before[0]) and torch.equal(step["value_cache"], before[1])


def test_reshape_and_cache_reads_strided_key_and_value():
    """K and V as views into one fused QKV projection output, as a model produces them."""
    step = make_step(6, 2, 16, 4, torch.float32, torch.int64)
    qkv = torch.randn(6, 3, 2, 16, device=DEVICE)  # [tokens, q/k/v, kv_heads, head_dim]
    step["key"], step["value"] = qkv[:, 1], qkv[:, 2]
    expected_k, expected_v = step["key_cache"].clone(), step["value_cache"].clone()
    ref_reshape_and_cache(qkv[:, 1], qkv[:, 2], expected_k, expected_v, step["slot_mapping"])

    reshape_and_cache(**step)

    assert torch.equal(step["key_cache"], expected_k)
    assert torch.equal(step["value_cache"], expected_v)


BAD_INPUTS = [
    ("key", lambda s: s["key"][:, :1], "value shape"),
    ("key", lambda s: s["key"][0], "key must be a 3-d tensor"),
    ("key", lambda s: s["key"][..., :8], "value shape"),
    ("value_cache", lambda s: s["value_cache"].half(), "value_cache .* must match key_cache"),
    ("key_cache", lambda s: s["key_cache"].half(), "must match key_cache|key_cache dtype"),
    ("slot_mapping", lambda s: s["slot_mapping"].float(), "slot_mapping must have dtype"),
    ("slot_mapping", lambda s: s["slot_mapping"][:-1], "slot_mapping has 5 entries for 6 tokens"),
    ("key", lambda s: s["key"].transpose(1, 2).contiguous().transpose(1, 2), "last dimension"),
]


@pytest.mark.parametrize("name, corrupt, message", BAD_INPUTS)
def test_reshape_and_cache_rejects_bad_inputs(name, corrupt, message):
    step = make_step(6, 2, 16, 4, torch.float32, torch.int64)
    step[name] = corrupt(step)

    with pytest.raises(ValueError, match=message):
        reshape_and_cache(**step)


def test_reshape_and_cache_rejects_caches_of_another_head_dim():
    step = make_step(6, 2, 16, 4, torch.float32, torch.int64)
    step["key_cache"] = step["key_cache"][..., :8]
    step["value_cache"] = step["value_cache"][..., :8]

    with pytest.raises(ValueError, match="does not match key's num_kv_heads=2, head_dim=16"):
        reshape_and_cache(**step)


def test_reshape_and_cache_rejects_mismatched_key_cache_dtype():
    step = make_step(6, 2, 16, 4, torch.float32, torch.int64)
    step["key_cache"], step["value_cache"] = step["key_cache"].half(), step["value_cache"].half()

    with pytest.raises(ValueError, match="key_cache dtype torch.float16 != key dtype"):
        reshape_and_cache(**step)
