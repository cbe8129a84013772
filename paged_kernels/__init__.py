"""Paged KV-cache kernels: Triton kernels, each beside a pure-torch reference of the same signature.

* write the step's K/V into the cache: ``paged_kernels.cache.reshape_and_cache`` (Triton);
* attention over the cache: ``paged_kernels.paged_attention.paged_attention`` (Triton);
* ``paged_kernels.reference``: the plain torch oracle of both (``ref_reshape_and_cache``,
  ``ref_paged_attention``), short and obviously correct, that every kernel is tested against;
* ``paged_kernels.cpu``: the tuned CPU path of both (``cpu_reshape_and_cache``, ``cpu_paged_attention``:
  vectorised torch, attention — decode rows, and prefill chunks a row per token — in C where a
  compiler built ``csrc/``; see ``paged_kernels.native``).

The Triton kernels run on CUDA (or on the CPU under ``TRITON_INTERPRET=1``, for tests).

Pick a pair with :func:`get_attention_ops` (:data:`BACKENDS`). Importing this package does not
import Triton: CPU-only users never pay for, or fail on, Triton.

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

__all__ = ["BACKENDS", "AttentionOps", "get_attention_ops", "resolve_backend"]


# The one description of the attention backends; ``--attention-backend``'s help is built from it.
BACKENDS = {
    "auto": "triton where CUDA is available, else cpu",
    "triton": "the Triton kernels (CUDA; the CPU only under TRITON_INTERPRET=1)",
    "cpu": "the tuned CPU path: vectorised torch, decode rows in C where a compiler is present",
    "torch": "the plain reference (slow: for checking the others)",
}


class AttentionOps(NamedTuple):
    """The two ops a model runner calls per attention layer, from one backend."""

    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    backend: str  # "triton", "cpu" or "torch": what "auto" resolved to


def resolve_backend(backend: str = "auto", device: str | None = None) -> str:
    """The backend ``backend`` names on ``device`` (``"cuda"``/``"cpu"``; None: CUDA if present)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if backend != "auto":
        return backend
    on_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    return "triton" if on_cuda else "cpu"


def get_attention_ops(backend: str = "auto", device: str | None = None) -> AttentionOps:
    """Return ``(reshape_and_cache, paged_attention, backend)`` for a name of :data:`BACKENDS`.

    Triton is imported only here, only when chosen. All backends take the same arguments; the
    Triton ops need CUDA tensors (or the interpreter), the others run on any device.
    """
    backend = resolve_backend(backend, device)
    if backend == "cpu":
        from paged_kernels.cpu import cpu_paged_attention, cpu_reshape_and_cache

        return AttentionOps(cpu_reshape_and_cache, cpu_paged_attention, "cpu")
    if backend == "torch":
        from paged_kernels.reference import ref_paged_attention, ref_reshape_and_cache

        return AttentionOps(ref_reshape_and_cache, ref_paged_attention, "torch")
    from paged_kernels.cache import reshape_and_cache
    from paged_kernels.paged_attention import paged_attention

    return AttentionOps(reshape_and_cache, paged_attention, "triton")
