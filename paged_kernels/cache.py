"""``reshape_and_cache``: scatter the step's new key/value rows into the paged KV cache (Triton).

One program per token writes all of its KV heads: a ``[num_kv_heads, head_dim]`` tile is read from
``key``/``value`` and stored at the token's slot. In the block-major layout
``[num_blocks, block_size, num_kv_heads, head_dim]`` that destination is one contiguous run of
``num_kv_heads * head_dim`` elements, so both the load and the store are fully coalesced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    require,
    require_dtype,
    require_kv_caches,
    require_rank,
    require_same_device,
    require_unit_last_stride,
)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int32/int64, -1 = skip
    stride_kt,
    stride_kh,  # key strides (token, head); head_dim stride is 1
    stride_vt,
    stride_vh,  # value strides (token, head)
    stride_cb,
    stride_cs,
    stride_ch,  # cache strides (block, slot in block, head), shared by both caches
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PADDED: tl.constexpr,  # next power of two of NUM_KV_HEADS
    HEAD_DIM_PADDED: tl.constexpr,  # next power of two of HEAD_DIM
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask)
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 or int32; -1 = do not store (padding)
) -> None:
    """Write each token's key/value rows into its cache slot, in place (Triton).

    Same contract as :func:`paged_kernels.reference.ref_reshape_and_cache`: ``slot = block * block_size +
    offset``, negative slots are skipped. Unlike the reference, the caches must already have the
    key's dtype. Slot values are not range-checked (that would need a device sync); an out-of-range
    slot writes out of bounds.
    """
    require_rank("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    require_rank("value", value, 3, "[num_tokens, num_kv_heads, head_dim]")
    require_kv_caches(key_cache, value_cache)
    require_rank("slot_mapping", slot_mapping, 1, "[num_tokens]")
    require(value.shape == key.shape, f"value shape {tuple(value.shape)} != key {tuple(key.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    require(
        tuple(key_cache.shape[2:]) == (num_kv_heads, head_dim),
        f"key_cache [num_blocks, block_size, num_kv_heads, head_dim] = {tuple(key_cache.shape)} "
        f"does not match key's num_kv_heads={num_kv_heads}, head_dim={head_dim}",
    )
    require(
        slot_mapping.shape[0] == num_tokens,
        f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens",
    )
    require_dtype("key", key, FLOAT_DTYPES)
    require_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    for name, tensor in (("value", value), ("key_cache", key_cache)):
        require(tensor.dtype == key.dtype, f"{name} dtype {tensor.dtype} != key dtype {key.dtype}")
    require_unit_last_stride("key", key)
    require_unit_last_stride("value", value)
    require(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    require_same_device(
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slot_mapping,
    )
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )
