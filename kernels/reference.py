"""Pure-torch references for the paged KV-cache kernels — and the CPU execution path.

Every function here has the same signature as its Triton twin (``kernels.cache`` and
``kernels.paged_attention``); the kernel tests compare the two. Because a worker without a GPU runs
these functions for real, they are vectorised: no Python loop per token, one loop per *prefill*
sequence at most (decode rows are batched together).

Cache layout (see ``kernels/__init__.py`` for why): ``key_cache, value_cache:
[num_blocks, block_size, num_kv_heads, head_dim]``; token at position ``p`` of a sequence lives in
slot ``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ref_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 or int32; -1 = do not store (padding)
) -> None:
    """Write each token's key/value rows into its cache slot, in place.

    ``slot = block * block_size + offset``; tokens whose slot is negative are skipped. Values are
    cast to the cache's dtype. Slots are assumed distinct (two tokens never share a slot).
    """
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indexing on the two leading dims works for any strides (a flattened view might copy).
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def ref_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    num_splits: int | None = None,  # accepted for signature parity with the Triton op; unused
    max_query_len: int | None = None,  # likewise unused (the reference syncs freely)
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged K/V cache.

    Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s + 1]`` (``q_len`` rows, at
    least one); its row ``i`` sits at position ``seq_lens[s] - q_len + i`` and attends to cache
    positions ``0..`` that position (the new tokens' K/V must already be in the cache). Query head
    ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA). Softmax in fp32; the result is
    in ``query``'s dtype (written into ``out`` when given, which is also returned).

    Decode rows are batched by padding to the longest context of a group, so a row's
    ``block_tables`` entries past its own blocks are gathered (then masked): they must be valid
    block ids (0, the null block, is fine), and the cache must hold no NaN/inf (zero-initialised).
    """
    del num_splits, max_query_len
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    qsl = query_start_loc.to(device="cpu", dtype=torch.int64).tolist()
    lens = seq_lens.to(device="cpu", dtype=torch.int64).tolist()
    q_lens = [qsl[s + 1] - qsl[s] for s in range(num_seqs)]
    if all(n == 1 for n in q_lens):  # pure decode: batched, no per-sequence loop
        _decode(query, key_cache, value_cache, block_tables, seq_lens, lens, scale, out)
        return out

    decode_seqs = [s for s in range(num_seqs) if q_lens[s] == 1]
    if decode_seqs:
        index = torch.tensor(decode_seqs, device=query.device)
        rows = torch.tensor([qsl[s] for s in decode_seqs], device=query.device)
        decode_out = torch.empty_like(query[rows])
        _decode(
            query[rows],
            key_cache,
            value_cache,
            block_tables[index],
            seq_lens[index],
            [lens[s] for s in decode_seqs],
            scale,
            decode_out,
        )
        out[rows] = decode_out
    for s in range(num_seqs):
        if q_lens[s] > 1:
            out[qsl[s] : qsl[s + 1]] = _prefill(
                query[qsl[s] : qsl[s + 1]], key_cache, value_cache, block_tables[s], lens[s], scale
            )
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, num_positions: int) -> torch.Tensor:
    """fp32 ``[*block_ids.shape[:-1], num_kv_heads, num_positions, head_dim]`` view of cached rows.

    One ``index_select`` copy (plus a cast for 16-bit caches); the head transpose stays a view
    because SDPA's CPU kernel reads strided K/V as fast as contiguous ones.
    """
    lead = block_ids.shape[:-1]
    rows = cache.index_select(0, block_ids.reshape(-1))  # [n, block_size, num_kv_heads, head_dim]
    rows = rows.view(*lead, -1, cache.shape[2], cache.shape[3])[..., :num_positions, :, :]
    return rows.float().transpose(-3, -2)


# Decode gathers at most this many bytes of fp32 K (and as many of V) per group of sequences, so a
# large batch with long contexts needs bounded scratch memory (256 sequences x 4k tokens would
# otherwise gather gigabytes) at the cost of a few more SDPA calls.
_DECODE_GATHER_BYTES = 16 << 20


def _decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    lens: list[int],  # seq_lens on the host
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], written
) -> None:
    """Groups of sequences at once: K/V gathered and padded to the group's longest context.

    The query heads sharing a KV head become SDPA's query-length axis (a decode row's mask is the
    same for all of them), so GQA needs no K/V repeat.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    bytes_per_seq = max(lens) * num_kv_heads * head_dim * 4
    step = max(1, _DECODE_GATHER_BYTES // bytes_per_seq)
    for first in range(0, num_seqs, step):
        last = min(first + step, num_seqs)
        max_len = max(lens[first:last])
        block_ids = block_tables[first:last, : -(-max_len // block_size)].long()
        k = _gather(key_cache, block_ids, max_len)  # [n, num_kv_heads, max_len, head_dim]
        v = _gather(value_cache, block_ids, max_len)
        positions = torch.arange(max_len, device=query.device)
        valid = positions[None, :] < seq_lens[first:last, None].to(positions.dtype)
        o = F.scaled_dot_product_attention(
            query[first:last].float().view(last - first, num_kv_heads, group, head_dim),
            k,
            v,
            attn_mask=valid[:, None, None, :],  # [n, 1, 1, max_len]
            scale=scale,
        )
        out[first:last] = o.view(last - first, num_heads, head_dim)


def _prefill(
    query: torch.Tensor,  # [q_len, num_heads, head_dim], the last q_len positions of the sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim] fp32
    """One sequence's chunk: contiguous K/V, causal mask offset by the context already cached."""
    q_len, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    block_ids = block_table[: -(-seq_len // block_size)].long()
    k = _gather(key_cache, block_ids, seq_len)  # [num_kv_heads, seq_len, head_dim]
    v = _gather(value_cache, block_ids, seq_len)
    query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    key_pos = torch.arange(seq_len, device=query.device)
    allowed = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
    o = F.scaled_dot_product_attention(
        query.float().transpose(0, 1),  # [num_heads, q_len, head_dim]
        k,
        v,
        attn_mask=allowed,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return o.transpose(0, 1)
