"""Factories for the kernel tests: a paged batch with shuffled block tables over a large-ish cache.

The whole cache is random, including blocks no sequence owns and the unused tail of each block
table row (which points at other random blocks): a kernel that reads one position too many, or the
wrong block, changes the result instead of reading harmless zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    scale: float

    def args(self) -> tuple:
        """Positional arguments of ``paged_attention`` / ``ref_paged_attention``."""
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
        )


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    num_blocks: int = 512,
    seed: int = 0,
    head_major: bool = False,
) -> PagedBatch:
    """Sequence ``s`` has ``seq_lens[s]`` tokens in the cache; the last ``q_lens[s]`` are new.

    ``head_major``: the caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` views of
    ``[num_kv_heads, num_blocks, block_size, head_dim]`` memory, as the worker allocates them on the CPU.
    """
    assert all(0 < q <= n for q, n in zip(q_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 2  # a spare column or two, as a real block table has
    assert sum(blocks_per_seq) <= num_blocks
    owned = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen)
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = torch.tensor(owned[:n])
        owned = owned[n:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    key_cache, value_cache = (torch.randn(cache_shape, generator=gen).to(dtype) for _ in range(2))
    if head_major:
        key_cache, value_cache = (c.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
                                  for c in (key_cache, value_cache))
    return PagedBatch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(torch.int32),
        query_start_loc=query_start_loc.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


@pytest.fixture
def paged_batch():
    """The :func:`make_paged_batch` factory."""
    return make_paged_batch


STORAGES = ["block-major", "head-major", "strided"]


@pytest.fixture(params=STORAGES)
def storage(request) -> str:
    """Each memory order a cache may have behind its logical layout."""
    return request.param


def empty_cache(storage: str, num_blocks: int = 8, block_size: int = 4, num_kv_heads: int = 2,
                head_dim: int = 16) -> torch.Tensor:
    """A zero cache with the logical layout ``[num_blocks, block_size, num_kv_heads, head_dim]`` over
    block-major, head-major (the CPU worker's) or strided (every other block) memory."""
    if storage == "block-major":
        return torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    if storage == "head-major":
        return torch.zeros(num_kv_heads, num_blocks, block_size, head_dim).permute(1, 2, 0, 3)
    return torch.zeros(2 * num_blocks, block_size, num_kv_heads, head_dim)[::2]


@pytest.fixture(name="empty_cache")
def empty_cache_fixture():
    return empty_cache
