"""``paged_attention``: causal attention of a mixed batch over the paged KV cache (Triton).

One launch serves a whole continuous-batching step: decode rows (``q_len == 1``) and prefill chunks
(``q_len > 1``, with earlier chunks already in the cache) side by side, GQA, any block size.

Work split. A program owns one *query block* (``BLOCK_Q`` consecutive new tokens of one sequence)
times one KV head, and processes all ``num_heads // num_kv_heads`` query heads of that KV head
together: its ``BLOCK_M = BLOCK_Q * queries_per_kv`` rows share every K/V tile it loads, so K/V is
read once per KV group rather than once per query head (the decode path is bandwidth-bound, this is
what matters). The K/V loop walks ``TILE_SIZE`` positions per iteration; each position finds its
physical block through the block table, so a tile may span several cache blocks (or part of one)
and ``TILE_SIZE`` is tuned independently of ``block_size``. Softmax is online (running max and sum,
in base 2 with the scale folded into ``qk_scale``), accumulation in fp32.

Grid without a host sync. Sequence ``s`` is given query blocks starting at
``query_start_loc[s] // BLOCK_Q + s``; that is always enough room for its ``cdiv(q_len, BLOCK_Q)``
blocks, so ``num_tokens // BLOCK_Q + num_seqs`` programs cover every batch, spare ones exit at once,
and a program finds its sequence by binary search over ``query_start_loc`` (vLLM's unified
attention does the same). A decode-only batch skips both: one program per sequence.

Split-K ("V2" in the original PagedAttention). When a batch has too few ``(query block, KV head)``
programs to fill the GPU (a handful of long decodes), a third grid axis cuts each program's tile
range into ``num_splits`` contiguous parts. Each part writes its unnormalised output with its
running max and sum to fp32 scratch; ``_merge_splits_kernel`` rescales the parts to the common max
and combines them. Split 0 always holds position 0, which every query row may see, so the merged
max is finite for every real row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_kernels._checks import check_paged_attention_inputs, interpreted, require

_LOG2_E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks include global block ``q_block`` (largest ``s`` whose first
    block ``query_start_loc[s] // BLOCK_Q + s`` is ``<= q_block``)."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` with an fp32 accumulator. ``UPCAST`` works around Triton's interpreter, which
    multiplies bf16 operands as their raw 16-bit integers; a product of two bf16 values is exact in
    fp32, so upcasting first gives the same sums a tensor core would (up to summation order)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]; written when NUM_SPLITS == 1
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PADDED] fp32, unnormalised
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, running max (log2 units)
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, running sum of exp2
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32, context length including the new tokens
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    stride_qt,
    stride_qh,  # query strides (token, head); head_dim stride is 1
    stride_ot,
    stride_oh,  # out strides (token, head)
    stride_cb,
    stride_cs,
    stride_ch,  # cache strides (block, slot in block, head), shared by both caches
    stride_bt,  # block_tables row stride
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,  # power of two >= max(HEAD_DIM, 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    QUERIES_PER_KV: tl.constexpr,  # num_heads // num_kv_heads
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_M: tl.constexpr,  # rows per program, >= BLOCK_Q * QUERIES_PER_KV, power of two >= 16
    TILE_SIZE: tl.constexpr,  # K/V positions per loop iteration
    NUM_SPLITS: tl.constexpr,  # 1: write `out`; > 1: write this split's partial result
    ONE_TOKEN_PER_SEQ: tl.constexpr,  # grid axis 0 is the sequence (needs BLOCK_Q == 1)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), else "tf32" (unused by 16-bit)
    DOT_UPCAST: tl.constexpr,  # bf16 under the interpreter: see `_dot`
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if ONE_TOKEN_PER_SEQ:  # decode-only batch: one program per sequence, no search
        seq = q_block
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    seq_q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - seq_q_start
    if ONE_TOKEN_PER_SEQ:
        q_block_in_seq = 0
    else:
        q_block_in_seq = q_block - (seq_q_start // BLOCK_Q + seq)
    if q_block_in_seq * BLOCK_Q >= q_len:  # spare program
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step's chunk

    # Row r is new token (r // QUERIES_PER_KV) of this block, query head (r % QUERIES_PER_KV) of
    # the group.
    rows = tl.arange(0, BLOCK_M)
    q_in_block = rows // QUERIES_PER_KV
    q_idx = q_block_in_seq * BLOCK_Q + q_in_block  # index among the sequence's new tokens
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (q_in_block < BLOCK_Q) & (q_idx < q_len)
    q_pos = context_len + q_idx  # position in the sequence: the row sees keys 0..q_pos
    token = (seq_q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM

    q = tl.load(
        query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PADDED]

    # Keys this block needs: 0 .. its last new token's position.
    kv_len = tl.minimum(context_len + (q_block_in_seq + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(kv_len, TILE_SIZE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_t = tl.arange(0, TILE_SIZE)
    for tile in range(tile_begin, tile_end):
        kv_pos = tile * TILE_SIZE + offs_t  # [TILE_SIZE]
        kv_valid = kv_pos < kv_len
        physical_block = tl.load(block_table + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0)
        kv_offset = (
            physical_block.to(tl.int64) * stride_cb
            + (kv_pos % BLOCK_SIZE) * stride_cs
            + kv_head * stride_ch
        )
        k = tl.load(
            key_cache_ptr + kv_offset[None, :] + dims[:, None],
            mask=kv_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )  # [HEAD_DIM_PADDED, TILE_SIZE]
        v = tl.load(
            value_cache_ptr + kv_offset[:, None] + dims[None, :],
            mask=kv_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [TILE_SIZE, HEAD_DIM_PADDED]

        s = _dot(q, k, DOT_PRECISION, DOT_UPCAST) * qk_scale  # [BLOCK_M, TILE_SIZE]
        visible = row_valid[:, None] & (kv_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen nothing yet keeps max -inf: subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        num_heads = QUERIES_PER_KV * tl.num_programs(1)
        part = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M] int64
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM_PADDED + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PADDED] fp32
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,  # next power of two of NUM_SPLITS
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * tl.num_programs(1) + head
    splits = tl.arange(0, SPLITS_PADDED)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_PADDED)

    maxes = tl.load(part_max_ptr + row * NUM_SPLITS + splits, mask=split_valid, other=float("-inf"))
    sums = tl.load(part_sum_ptr + row * NUM_SPLITS + splits, mask=split_valid, other=0.0)
    weight = tl.exp2(maxes - tl.max(maxes, axis=0))  # an empty split (max -inf) weighs 0
    parts = tl.load(
        part_out_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM_PADDED + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )  # [SPLITS_PADDED, HEAD_DIM_PADDED]
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(sums * weight, axis=0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@dataclass(frozen=True)
class _LaunchConfig:
    """Block shape and scheduling of one launch (`_choose_config` picks it; benchmarks sweep it)."""

    block_m: int  # rows per program (power of two >= 16)
    block_q: int  # new tokens per program: block_m // queries_per_kv, at least 1
    tile_size: int  # K/V positions per loop iteration (power of two >= 16)
    num_splits: int  # split-K parts; 1 = single pass
    one_token_per_seq: bool = False  # decode-only batch: grid axis 0 is the sequence
    num_warps: int = 4
    num_stages: int = 3


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    num_splits: int | None = None,
    max_query_len: int | None = None,
    step_cache: dict | None = None,  # signature parity with the CPU op; unused (the launcher derives little)
) -> torch.Tensor:
    """Causal paged attention for a mixed decode/prefill batch in one launch (Triton).

    Same contract as :func:`paged_kernels.reference.ref_paged_attention`, including that every sequence
    has at least one new token. ``num_splits``: ``None`` lets a heuristic decide (split-K only for
    decode-only batches with too few sequences to fill the GPU), ``1`` forces the single pass,
    ``n > 1`` forces ``n`` context splits plus a merge kernel. ``max_query_len`` is the longest
    ``q_len`` if the caller knows it (it must not be an underestimate); it only picks the block
    shape. Without it, ``num_tokens == num_seqs`` identifies a decode-only batch. The launcher never
    reads device values, so it does not sync and can be captured in a CUDA graph.
    """
    del step_cache
    check_paged_attention_inputs(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out
    )
    require(
        num_splits is None or (isinstance(num_splits, int) and num_splits >= 1),
        f"num_splits must be None or an int >= 1, got {num_splits!r}",
    )
    require(
        max_query_len is None or (isinstance(max_query_len, int) and max_query_len >= 1),
        f"max_query_len must be None or an int >= 1, got {max_query_len!r}",
    )
    config = _choose_config(
        num_tokens=query.shape[0],
        num_seqs=seq_lens.shape[0],
        num_kv_heads=key_cache.shape[2],
        queries_per_kv=query.shape[1] // key_cache.shape[2],
        head_dim=query.shape[2],
        max_query_len=max_query_len,
        num_splits=num_splits,
        device=query.device,
    )
    return _launch(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out, config
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number, so tests reach both heuristic branches
    return torch.cuda.get_device_properties(device).multi_processor_count


def _choose_config(
    *,
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    max_query_len: int | None,
    num_splits: int | None,
    device: torch.device,
) -> _LaunchConfig:
    """Pick the block shape and split count from host-side facts only (no device sync)."""
    decode_only = max_query_len == 1 if max_query_len is not None else num_tokens == num_seqs
    min_rows = max(16, triton.next_power_of_2(queries_per_kv))  # tl.dot needs M >= 16
    if decode_only:
        # One new token per sequence: a program is one sequence x one KV group; its rows are the
        # group's query heads. Bandwidth-bound, so a wide K/V tile per iteration.
        block_m, block_q = min_rows, 1
        tile_size = 64 if head_dim <= 128 else 32
    else:
        long_chunks = max_query_len is not None and max_query_len >= 128
        block_m = max(64, min_rows) if long_chunks else min_rows
        block_q = max(1, block_m // queries_per_kv)
        tile_size = 32 if block_m >= 64 or head_dim > 128 else 64
    if num_splits is None:
        num_splits = 1
        if decode_only:
            # Aim for ~4 programs per SM; below ~2 the GPU's bandwidth is not saturated.
            programs, sms = num_seqs * num_kv_heads, _num_sms(device)
            if programs < 2 * sms:
                num_splits = min(16, triton.next_power_of_2(-(-4 * sms // max(programs, 1))))
    return _LaunchConfig(block_m, block_q, tile_size, num_splits, one_token_per_seq=decode_only)


def _launch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    config: _LaunchConfig,
) -> torch.Tensor:
    """Run the kernel(s) with an explicit config; inputs must already be checked."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert config.block_m >= config.block_q * queries_per_kv, config
    assert config.block_q == 1 or not config.one_token_per_seq, config
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    splits = config.num_splits
    fp32 = dict(dtype=torch.float32, device=query.device)
    if splits > 1:
        part_out = torch.empty((num_tokens, num_heads, splits, head_dim_padded), **fp32)
        part_max = torch.empty((num_tokens, num_heads, splits), **fp32)
        part_sum = torch.empty_like(part_max)
    else:  # unused by the single pass; any fp32 tensor satisfies the signature
        part_out = part_max = part_sum = torch.empty(1, **fp32)

    if config.one_token_per_seq:
        grid = (num_seqs, num_kv_heads, splits)
    else:
        grid = (num_tokens // config.block_q + num_seqs, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        out,
        part_out,
        part_max,
        part_sum,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * _LOG2_E,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=key_cache.shape[1],
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_Q=config.block_q,
        BLOCK_M=config.block_m,
        TILE_SIZE=config.tile_size,
        NUM_SPLITS=splits,
        ONE_TOKEN_PER_SEQ=config.one_token_per_seq,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_UPCAST=query.dtype == torch.bfloat16 and interpreted(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            NUM_SPLITS=splits,
            SPLITS_PADDED=triton.next_power_of_2(splits),
        )
    return out
