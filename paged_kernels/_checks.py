"""Input checks shared by the Triton launchers; a failure raises a ValueError naming the argument.

A kernel reads raw pointers with the strides it is given, so a wrong shape or dtype would not fail
loudly — it would read the wrong memory. The launchers therefore check everything that is cheap to
check on the host (shapes, dtypes, devices, strides); the *values* of slot mappings, block tables
and lengths stay unchecked, since reading them would cost a device-to-host sync on every call.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def require_rank(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    require(
        isinstance(tensor, torch.Tensor) and tensor.dim() == rank,
        f"{name} must be a {rank}-d tensor {layout}, got "
        f"{tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}",
    )


def require_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    require(
        tensor.dtype in allowed,
        f"{name} must have dtype in {[str(d) for d in allowed]}, got {tensor.dtype}",
    )


def require_unit_last_stride(name: str, tensor: torch.Tensor) -> None:
    require(
        tensor.stride(-1) == 1 or tensor.shape[-1] == 1,
        f"{name} must be contiguous in its last dimension, got strides {tensor.stride()}",
    )


def interpreted() -> bool:
    """Whether Triton kernels run in the interpreter (decided when they were defined; read here at
    call time, never at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_kv_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Both caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` with the same shape, dtype
    and strides (the kernels take one set of strides for both), ``head_dim`` contiguous."""
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    require_rank("key_cache", key_cache, 4, layout)
    require_rank("value_cache", value_cache, 4, layout)
    require(
        value_cache.shape == key_cache.shape
        and value_cache.stride() == key_cache.stride()
        and value_cache.dtype == key_cache.dtype,
        f"value_cache ({tuple(value_cache.shape)}, strides {value_cache.stride()}, "
        f"{value_cache.dtype}) must match key_cache ({tuple(key_cache.shape)}, strides "
        f"{key_cache.stride()}, {key_cache.dtype})",
    )
    require_unit_last_stride("key_cache", key_cache)


def require_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and one that Triton can run on (CUDA, or the CPU interpreter)."""
    devices = {name: t.device for name, t in tensors.items()}
    first_name, device = next(iter(devices.items()))
    for name, other in devices.items():
        require(other == device, f"{name} is on {other} but {first_name} is on {device}")
    require(
        device.type == "cuda" or (interpreted() and device.type == "cpu"),
        f"Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
        f"kernels are imported), got {device}; use paged_kernels.reference on the CPU",
    )
    return device


def check_paged_attention_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Everything ``paged_attention`` can check without reading device memory."""
    require_rank("query", query, 3, "[num_tokens, num_heads, head_dim]")
    require_kv_caches(key_cache, value_cache)
    require_rank("block_tables", block_tables, 2, "[num_seqs, max_blocks]")
    require_rank("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    require_rank("seq_lens", seq_lens, 1, "[num_seqs]")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    require(
        key_cache.shape[3] == head_dim,
        f"key_cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}",
    )
    require(
        num_kv_heads >= 1 and num_heads % num_kv_heads == 0,
        f"query's num_heads ({num_heads}) must be a multiple of the cache's num_kv_heads "
        f"({num_kv_heads})",
    )
    num_seqs = seq_lens.shape[0]
    require(
        query_start_loc.shape[0] == num_seqs + 1,
        f"query_start_loc has {query_start_loc.shape[0]} entries for {num_seqs} sequences "
        f"(needs num_seqs + 1)",
    )
    require(
        block_tables.shape[0] >= num_seqs,
        f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences",
    )
    require_dtype("query", query, FLOAT_DTYPES)
    require(
        key_cache.dtype == query.dtype,
        f"key_cache dtype {key_cache.dtype} != query dtype {query.dtype}",
    )
    for name, tensor in (
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        require_dtype(name, tensor, (torch.int32,))
    require_unit_last_stride("query", query)
    require_unit_last_stride("block_tables", block_tables)
    require(query_start_loc.is_contiguous(), "query_start_loc must be contiguous")
    require(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    tensors = dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )
    if out is not None:
        require(
            out.shape == query.shape and out.dtype == query.dtype,
            f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}",
        )
        require_unit_last_stride("out", out)
        tensors["out"] = out
    require_same_device(**tensors)
