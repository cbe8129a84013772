"""bf16 prefill chunks on AMX tiles (``csrc/amx_prefill_attention.c``) against the fp32 torch
reference, and which chunks take them. Runs where the CPU has AMX-BF16 (Intel Sapphire Rapids and
later) and Linux grants the tile registers; elsewhere the dispatch test still runs."""

from __future__ import annotations

import pytest
import torch

from paged_kernels import cpu, native
from paged_kernels.reference import ref_paged_attention

pytestmark = pytest.mark.kernel

needs_amx = pytest.mark.skipif(not cpu.amx_prefill_available(), reason="no AMX-BF16 tile kernel on this CPU")

# bf16 results rounded once, to bf16, from fp32 sums (P rounded to bf16 before P V, as SDPA does)
TOLERANCE = dict(atol=1.5e-2, rtol=1e-2)


@needs_amx
@pytest.mark.parametrize("lens", [
    dict(q_lens=[8], seq_lens=[8]),  # the fewest rows the tiles take: one partial query block
    dict(q_lens=[16, 17, 33], seq_lens=[16, 40, 33]),  # whole, partial and context-shifted blocks
    dict(q_lens=[100, 64], seq_lens=[300, 1088]),  # a cached prefix before the chunk
    dict(q_lens=[256], seq_lens=[256]),
], ids=["8", "block-edges", "with-context", "256"])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("head_major", [False, True], ids=["block-major", "head-major"])
def test_tiles_match_the_reference(paged_batch, lens, gqa, head_dim, block_size, head_major):
    batch = paged_batch(**lens, num_heads=3 * gqa, num_kv_heads=3, head_dim=head_dim, block_size=block_size,
                        head_major=head_major, dtype=torch.bfloat16, num_blocks=2048 // block_size * 2)
    out = cpu.cpu_paged_attention(*batch.args())
    torch.testing.assert_close(out.float(), ref_paged_attention(*batch.args()).float(), **TOLERANCE)


@needs_amx
@pytest.mark.parametrize("spread", [1.0, 6.0, 30.0])
def test_scores_far_apart_stay_exact(paged_batch, spread):
    """Large and rising scores: the row maximum is raised (and the sums rescaled) as keys pass it by
    more than the margin, and weights e^-30 below the top underflow to nothing, as in the reference."""
    batch = paged_batch(q_lens=[96], seq_lens=[700], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                        head_major=True, dtype=torch.bfloat16, seed=3)
    ramp = torch.linspace(0, spread, batch.key_cache.shape[0] * batch.key_cache.shape[1])
    key_cache = (batch.key_cache.float() * spread).to(torch.bfloat16)
    key_cache += ramp.view(-1, batch.key_cache.shape[1], 1, 1).to(torch.bfloat16)  # later blocks score higher
    args = (batch.query, key_cache, *batch.args()[2:])
    out = cpu.cpu_paged_attention(*args)
    torch.testing.assert_close(out.float(), ref_paged_attention(*args).float(), **TOLERANCE)


@needs_amx
def test_a_chunk_on_tiles_is_the_same_alone_and_in_a_batch(paged_batch):
    batch = paged_batch(q_lens=[40, 1, 70], seq_lens=[90, 33, 70], num_heads=9, num_kv_heads=3, head_dim=64,
                        block_size=16, head_major=True, dtype=torch.bfloat16)
    together = cpu.cpu_paged_attention(*batch.args())
    alone = cpu.cpu_paged_attention(batch.query[:40], batch.key_cache, batch.value_cache, batch.block_tables[:1],
                                    torch.tensor([0, 40], dtype=torch.int32), batch.seq_lens[:1], batch.scale)
    assert torch.equal(alone, together[:40])


@pytest.mark.skipif(not cpu.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bf16_chunks_of_8_rows_or_more_take_the_tiles(paged_batch, monkeypatch, dtype):
    """With AMX, bf16 chunks of at least _AMX_MIN_ROWS rows go to the tile kernel; shorter chunks,
    decode rows and fp32 do not. Where the kernel cannot run (no AMX here) they fall back."""
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    tile_rows = []
    tiles = cpu._amx_prefill
    monkeypatch.setattr(cpu, "_amx_prefill", lambda *args: (ran := tiles(*args)) and tile_rows.append(args[0].shape[0])
                        or ran)
    batch = paged_batch(q_lens=[100, 8, 7, 1], seq_lens=[300, 40, 7, 77], num_heads=6, num_kv_heads=2, head_dim=64,
                        block_size=16, head_major=True, dtype=dtype)

    out = cpu.cpu_paged_attention(*batch.args())

    on_tiles = dtype == torch.bfloat16 and cpu.amx_prefill_available()
    assert tile_rows == ([100, 8] if on_tiles else [])
    tolerance = TOLERANCE if dtype == torch.bfloat16 else dict(atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.float(), ref_paged_attention(*batch.args()).float(), **tolerance)
