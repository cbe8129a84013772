"""Pure-torch references for the paged KV-cache kernels: the oracle every kernel is tested against.

Each function has the signature of its kernels (``paged_kernels.cache`` / ``paged_kernels.paged_attention`` in
Triton, ``paged_kernels.cpu`` for the tuned CPU path). They are written to be obviously correct, not
fast: one Python loop per sequence, K/V copied out through the block table position by position,
plain causal attention in fp32. Nothing serves traffic through them unless asked to
(``--attention-backend torch``).

Cache layout (see ``paged_kernels/__init__.py`` for why): ``key_cache, value_cache:
[num_blocks, block_size, num_kv_heads, head_dim]``; token at position ``p`` of a sequence lives in
slot ``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import torch


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
    keep = slots >= 0
    slots = slots[keep]
    key_cache[slots // block_size, slots % block_size] = key[keep].to(key_cache.dtype)
    value_cache[slots // block_size, slots % block_size] = value[keep].to(value_cache.dtype)


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
    max_query_len: int | None = None,  # likewise unused
    step_cache: dict | None = None,  # likewise (the CPU op keeps what it derives from a step's metadata there)
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged K/V cache.

    Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s + 1]`` (``q_len`` rows, at
    least one); its row ``i`` sits at position ``seq_lens[s] - q_len + i`` and attends to cache
    positions ``0..`` that position (the new tokens' K/V must already be in the cache). Query head
    ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (GQA). Softmax in fp32; the result is
    in ``query``'s dtype (written into ``out`` when given, which is also returned).
    """
    del num_splits, max_query_len, step_cache
    if out is None:
        out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    group = query.shape[1] // key_cache.shape[2]
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[s] : starts[s + 1]].float()  # [q_len, num_heads, head_dim]
        q_len = q.shape[0]
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_tables[s, positions // block_size].long()
        k = key_cache[blocks, positions % block_size].float()  # [seq_len, num_kv_heads, head_dim]
        v = value_cache[blocks, positions % block_size].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # GQA
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, seq_len]
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        scores = scores.masked_fill(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
        out[starts[s] : starts[s + 1]] = o.to(out.dtype)
    return out
