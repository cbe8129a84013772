"""The CPU attention backend (``"cpu"``): decode rows in C, prefill chunks through the reference.

A decode row's attention is a pass over its whole cached context, bound by memory traffic; the
torch reference has to gather a sequence's blocks into a contiguous copy and then read that copy
again in SDPA. ``csrc/paged_decode_attention.c`` (built by :mod:`kernels.native`) reads every K/V
row once, straight from the paged cache, for all query heads of a KV head at a time. Prefill
chunks stay with the reference: there SDPA's tiled matmuls are the fast part and the gather is a
small fraction.

Same signature and result as :func:`kernels.reference.ref_paged_attention` (the kernel tests
compare the two). fp32 only, within the C kernel's limits (GQA group <= 16, head_dim <= 256,
block_size <= 128); anything else — or a machine without a C compiler — runs the reference, so this
op is always safe to call. :func:`available` tells whether the C path is there at all.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import native
from kernels.reference import _decode, paged_attention_with

_KERNEL = "paged_decode_attention"
_MAX_GROUP, _MAX_HEAD_DIM, _MAX_BLOCK_SIZE = 16, 256, 128


def _function() -> ctypes._CFuncPtr | None:
    library = native.load(_KERNEL)
    if library is None:
        return None
    fn = library.paged_decode_attention_f32
    if fn.argtypes is None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, i64, p, p, i64, i64, i64, p, i64, p, p, i64, i64,
                       i32, i32, i32, i32, i32, ctypes.c_float, i32]
        fn.restype = None
    return fn


def available() -> bool:
    """Whether the C decode kernel could be built and loaded on this machine."""
    return _function() is not None


def _supported(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    return (
        query.device.type == "cpu"
        and query.dtype == key_cache.dtype == value_cache.dtype == torch.float32
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= _MAX_GROUP
        and query.shape[2] <= _MAX_HEAD_DIM
        and key_cache.shape[1] <= _MAX_BLOCK_SIZE
        and query.stride(-1) == 1
        and key_cache.stride(-1) == 1
        and value_cache.stride() == key_cache.stride()
    )


def _native_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    lens: list[int],
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], written
) -> None:
    """The reference's ``_decode`` contract, in C when the inputs allow it."""
    fn = _function()
    if fn is None or not _supported(query, key_cache, value_cache) or min(lens) < 1:
        _decode(query, key_cache, value_cache, block_tables, seq_lens, lens, scale, out)
        return
    tables = block_tables.to(torch.int32).contiguous()
    lengths = seq_lens.to(torch.int32).contiguous()
    target = out if out.dtype == torch.float32 and out.stride(-1) == 1 else torch.empty_like(query)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    fn(query.data_ptr(), query.stride(0), query.stride(1),
       key_cache.data_ptr(), value_cache.data_ptr(),
       key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
       tables.data_ptr(), tables.stride(0), lengths.data_ptr(),
       target.data_ptr(), target.stride(0), target.stride(1),
       num_seqs, num_heads, num_kv_heads, head_dim, block_size, float(scale), torch.get_num_threads())
    if target is not out:
        out.copy_(target)


def cpu_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,  # signature parity with the Triton op; unused
    max_query_len: int | None = None,  # likewise
) -> torch.Tensor:
    """:func:`kernels.reference.ref_paged_attention`, with decode rows in C (see the module doc)."""
    del num_splits, max_query_len
    return paged_attention_with(_native_decode, query, key_cache, value_cache, block_tables, query_start_loc,
                                seq_lens, scale, out)
