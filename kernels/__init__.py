"""Paged KV-cache kernels: Triton kernels, each beside a pure-torch reference of the same signature.

* write the step's K/V into the cache: ``kernels.cache.reshape_and_cache`` (Triton) and
  ``kernels.reference.ref_reshape_and_cache`` (torch);
* attention over the cache: ``kernels.paged_attention.paged_attention`` (Triton) and
  ``kernels.reference.ref_paged_attention`` (torch).

The Triton kernels run on CUDA (or on the CPU under ``TRITON_INTERPRET=1``, for tests); the torch
references are what the tests compare against and the CPU execution path, except that decode rows
— memory-bound passes over the whole context — go to a C loop beside the reference when a C compiler
is there (backend ``"cpu"``; the reference alone is ``"torch"``).

Pick a pair with :func:`get_attention_ops` (``"auto"``: Triton when CUDA is available, else torch).
Importing this package does not import Triton: CPU-only users import ``kernels.reference`` (or call
``get_attention_ops("torch")``) without paying for, or failing on, Triton.

KV-cache layout — one tensor for K and one for V per layer, **block-major**::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]

Token position ``p`` of a sequence lives in slot ``block_table[p // block_size] * block_size +
p % block_size``, i.e. at ``key_cache[slot // block_size, slot % block_size]``. Why this layout:

* each token's row of ``head_dim`` values is contiguous (and all its KV heads are contiguous too),
  so the attention kernel's K/V loads and ``reshape_and_cache``'s stores are coalesced, wide vector
  accesses;
* the writer and the reader use the same layout (no transposed "x" packing to keep in sync), and
  strides are plain (block, slot, head, 1), so a tile of the K/V loop may span several cache blocks
  or part of one — the kernel's tile size is independent of ``block_size``;
* it is vLLM's flash-attention layout, and what ``torch`` indexing needs for the reference path
  (``key_cache[block_ids]`` gathers whole blocks).

That is the *logical* layout; every op takes strides, so the memory behind it may be ordered
otherwise. On the CPU the worker stores it head-major (``[num_kv_heads, num_blocks, block_size,
head_dim]`` memory, see ``worker_service.kv_cache``): the reference's gathers then copy contiguous
per-head tiles and SDPA reads contiguous K/V.

The original vLLM CUDA kernel (seed doc §1.2) uses ``[num_blocks, num_kv_heads, head_size/x,
block_size, x]`` for K so that one CUDA thread group can issue 16-byte vector loads of ``x``
elements across a block's tokens; a Triton kernel gets the same vectorisation from contiguous
``head_dim`` rows, without the extra layout.

Conventions shared by both implementations: ``block_tables``, ``query_start_loc`` and ``seq_lens``
are int32; ``slot_mapping`` is int32 or int64 with ``-1`` for tokens not to store; ``seq_lens``
counts the context *including* the step's new tokens, whose K/V ``reshape_and_cache`` must have
written before ``paged_attention`` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["AttentionOps", "get_attention_ops"]


class AttentionOps(NamedTuple):
    """The two ops a model runner calls per attention layer, from one backend."""

    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    backend: str  # "torch" or "triton": what "auto" resolved to


def get_attention_ops(backend: str = "auto") -> AttentionOps:
    """Return ``(reshape_and_cache, paged_attention, backend)`` for ``"torch"``, ``"cpu"``,
    ``"triton"`` or ``"auto"`` (Triton when ``torch.cuda.is_available()``; else ``"cpu"`` when its C
    decode kernel builds on this machine; else the torch reference).

    Triton is imported only here, only when chosen. All backends take the same arguments; the
    Triton ops need CUDA tensors (or the interpreter), the torch ops run on any device, and the
    ``"cpu"`` ops run anywhere too but use C only for fp32 CPU tensors. ``"cpu"`` asked for on a
    machine where the kernel can't be built gives the torch reference (``backend == "torch"``).
    """
    if backend == "auto":
        if torch.cuda.is_available():
            backend = "triton"
        else:
            from kernels import cpu

            backend = "cpu" if cpu.available() else "torch"
    if backend == "cpu":
        from kernels import cpu
        from kernels.reference import ref_reshape_and_cache

        if cpu.available():
            return AttentionOps(ref_reshape_and_cache, cpu.cpu_paged_attention, "cpu")
        backend = "torch"
    if backend == "torch":
        from kernels.reference import ref_paged_attention, ref_reshape_and_cache

        return AttentionOps(ref_reshape_and_cache, ref_paged_attention, "torch")
    if backend == "triton":
        from kernels.cache import reshape_and_cache
        from kernels.paged_attention import paged_attention

        return AttentionOps(reshape_and_cache, paged_attention, "triton")
    raise ValueError(f"attention backend must be 'auto', 'torch', 'cpu' or 'triton', got {backend!r}")
