"""bf16 prefill chunks on AMX tiles (``csrc/amx_prefill_attention.c``) against the fp32 torch
reference, and which chunks take them. Runs where the CPU has AMX-BF16 (Intel Sapphire Rapids and
later) and Linux grants the tile registers, or AVX512-BF16 (the tiles emulated, ``csrc/amx_tiles.h``);
elsewhere the dispatch tests still run."""

from __future__ import annotations

import pytest
import torch

from paged_kernels import cpu, native
from paged_kernels.reference import ref_paged_attention

pytestmark = pytest.mark.kernel

needs_amx = pytest.mark.skipif(not cpu.amx_prefill_available(), reason="no tile kernel (AMX-BF16 or AVX512-BF16) here")

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
    """With AMX, bf16 chunks of at least _AMX_MIN_ROWS rows go to the tile kernel, all in one call;
    shorter chunks, decode rows and fp32 do not. Where the kernel cannot run (no AMX here) they fall back."""
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    calls = []
    tiles = cpu._amx_prefill_batch

    def recording(query, key_cache, value_cache, block_tables, seqs, starts, q_lens, *args, **kwargs):
        ran = tiles(query, key_cache, value_cache, block_tables, seqs, starts, q_lens, *args, **kwargs)
        if ran:
            calls.append([q_lens[s] for s in seqs])
        return ran

    monkeypatch.setattr(cpu, "_amx_prefill_batch", recording)
    batch = paged_batch(q_lens=[100, 8, 7, 1], seq_lens=[300, 40, 7, 77], num_heads=6, num_kv_heads=2, head_dim=64,
                        block_size=16, head_major=True, dtype=dtype)

    out = cpu.cpu_paged_attention(*batch.args())

    on_tiles = dtype == torch.bfloat16 and cpu.amx_prefill_available()
    # emulated tiles (AVX512-BF16 without AMX) take chunks from 16 rows: the 8-row one goes as rows
    assert calls == (([[100]] if cpu.tiles_emulated() else [[100, 8]]) if on_tiles else [])
    tolerance = TOLERANCE if dtype == torch.bfloat16 else dict(atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.float(), ref_paged_attention(*batch.args()).float(), **tolerance)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("emulated", [False, True], ids=["amx", "emulated"])
def test_which_chunks_take_the_tiles(paged_batch, monkeypatch, emulated):
    """On AMX a chunk of 8 rows or more takes the tiles; on emulated tiles (a tile costs its full work
    whatever rows it holds) 16 rows or more and 2,048 (row, position) pairs or more; chunks shorter
    than the tiles' fewest rows go to the row kernel with the decode rows."""
    monkeypatch.setattr(cpu, "tiles_emulated", lambda: emulated)
    q_lens, seq_lens = [100, 8, 20, 16, 12, 1], [300, 1000, 30, 1040, 500, 77]
    batch = paged_batch(q_lens=q_lens, seq_lens=seq_lens, num_heads=6, num_kv_heads=2, head_dim=64,
                        block_size=16, head_major=True, dtype=torch.bfloat16)
    plan = cpu._step_plan(batch.query, batch.block_tables, batch.query_start_loc, batch.seq_lens)
    if emulated:
        assert plan.on_tiles == [0, 3] and plan.off_tiles == [2]  # 20 x 30: too few pairs
        assert plan.row_lens[:8] == list(range(993, 1001))  # the 8-row chunk as rows
    else:
        assert plan.on_tiles == [0, 1, 2, 3, 4] and plan.off_tiles == []


def chunks_sharing_a_prefix(paged_batch, *, prefix_blocks: int, block_size: int):
    """Prefill chunks of a step whose sequences share their first ``prefix_blocks`` cached blocks
    (prefix caching), with tails of their own: chunks of 64, 100 and 9 tokens after the prefix, one
    of 3 tokens (too few for the tiles), a decode row, the same sequence twice (identical tables and
    lengths), one of the same table ending elsewhere, and a chunk that shares nothing."""
    prefix = prefix_blocks * block_size
    q_lens = [64, 100, 9, 3, 1, 40, 40, 40, 50]
    seq_lens = [prefix + 64, prefix + 100, prefix + 9, prefix + 3, prefix + 20, prefix + 40, prefix + 40,
                prefix + 47, 300]
    batch = paged_batch(q_lens=q_lens, seq_lens=seq_lens, num_heads=9, num_kv_heads=3, head_dim=64,
                        block_size=block_size, head_major=True, dtype=torch.bfloat16, num_blocks=8192 // block_size)
    batch.block_tables[1:8, :prefix_blocks] = batch.block_tables[0, :prefix_blocks]
    batch.block_tables[6:8] = batch.block_tables[5]
    return batch


def alone(batch, s: int) -> torch.Tensor:
    """Sequence ``s``'s rows when it is the only sequence of the call."""
    qsl = batch.query_start_loc.tolist()
    one = torch.tensor([0, qsl[s + 1] - qsl[s]], dtype=torch.int32)
    return cpu.cpu_paged_attention(batch.query[qsl[s]:qsl[s + 1]], batch.key_cache, batch.value_cache,
                                   batch.block_tables[s:s + 1], one, batch.seq_lens[s:s + 1], batch.scale)


@needs_amx
@pytest.mark.parametrize("prefix_blocks,block_size", [(40, 16), (41, 16), (20, 32), (160, 4)],
                         ids=["prefix-of-whole-32s", "prefix-ends-mid-32", "blocks-of-32", "blocks-of-4-unshared"])
@pytest.mark.parametrize("budget", [None, 1], ids=["one-group", "a-group-per-chunk"])
def test_chunks_sharing_a_cached_prefix_in_one_call(paged_batch, monkeypatch, prefix_blocks, block_size, budget):
    """The step's chunks go to the tiles in one call, each shared 32-key block of the prefix packed
    once: every such chunk's rows are bit for bit what they are alone (the same arithmetic), within
    bf16 rounding of the reference, with the packed budget met by groups of chunks as well. The
    rows of the shorter chunk and the decode row read the prefix together (on tiles too: within
    bf16 rounding of what they get alone)."""
    if budget is not None:
        monkeypatch.setattr(cpu, "_AMX_PACKED_BUDGET", budget)
    batch = chunks_sharing_a_prefix(paged_batch, prefix_blocks=prefix_blocks, block_size=block_size)

    together = cpu.cpu_paged_attention(*batch.args())

    qsl = batch.query_start_loc.tolist()
    for s in range(len(qsl) - 1):
        if qsl[s + 1] - qsl[s] >= cpu._AMX_MIN_ROWS:
            assert torch.equal(together[qsl[s]:qsl[s + 1]], alone(batch, s)), f"sequence {s}"
        else:
            torch.testing.assert_close(together[qsl[s]:qsl[s + 1]].float(), alone(batch, s).float(), **TOLERANCE)
    torch.testing.assert_close(together.float(), ref_paged_attention(*batch.args()).float(), **TOLERANCE)


def shared_prefix_decode(paged_batch, *, num_seqs: int, prefix_blocks: int, head_dim: int = 64, gqa: int = 3,
                         dtype: torch.dtype = torch.bfloat16):
    """Decode rows of ``num_seqs`` sequences whose first ``prefix_blocks`` blocks (16 tokens each)
    are the same cached blocks, each with a tail of its own, beside two rows sharing nothing."""
    lens = [prefix_blocks * 16 + 1 + (7 * s) % 90 for s in range(num_seqs)]
    batch = paged_batch(q_lens=[1] * (num_seqs + 2), seq_lens=[*lens, 77, 300], num_heads=3 * gqa, num_kv_heads=3,
                        head_dim=head_dim, block_size=16, head_major=True, dtype=dtype, num_blocks=4096)
    batch.block_tables[1:num_seqs, :prefix_blocks] = batch.block_tables[0, :prefix_blocks]
    return batch


@needs_amx
@pytest.mark.parametrize("num_seqs", [3, 16, 21])  # 21: more than one work item of 16
@pytest.mark.parametrize("prefix_blocks", [8, 19, 64])  # one chunk of 128, a chunk and a part, eight chunks
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3])
def test_decode_rows_sharing_a_prefix_on_tiles_match_the_reference(paged_batch, num_seqs, prefix_blocks, head_dim,
                                                                   gqa):
    """The chunks a work item's sequences share run on tiles for all its rows at once (bf16 on AMX);
    each row stays within bf16 rounding of the reference."""
    batch = shared_prefix_decode(paged_batch, num_seqs=num_seqs, prefix_blocks=prefix_blocks, head_dim=head_dim,
                                 gqa=gqa)
    out = cpu.cpu_paged_attention(*batch.args())
    torch.testing.assert_close(out.float(), ref_paged_attention(*batch.args()).float(), **TOLERANCE)


@needs_amx
def test_shared_prefix_tiles_are_used_for_bf16_only(paged_batch, monkeypatch):
    """bf16 rows of a large enough group take the tiles (their results move by bf16 rounding from
    the rows' results alone); fp32 rows never do, and stay bit for bit what they are alone."""
    batch = shared_prefix_decode(paged_batch, num_seqs=16, prefix_blocks=16)
    on_tiles = cpu.cpu_paged_attention(*batch.args())
    monkeypatch.setattr(cpu, "_shares_on_tiles", lambda dtype: False)  # the row kernel alone
    without = cpu.cpu_paged_attention(*batch.args())
    assert not torch.equal(on_tiles[:16], without[:16])
    assert torch.equal(on_tiles[16:], without[16:])  # the rows sharing nothing
    monkeypatch.undo()
    fp32 = shared_prefix_decode(paged_batch, num_seqs=16, prefix_blocks=16, dtype=torch.float32)
    together = cpu.cpu_paged_attention(*fp32.args())
    alone = cpu.cpu_paged_attention(fp32.query[3:4], fp32.key_cache, fp32.value_cache, fp32.block_tables[3:4],
                                    torch.tensor([0, 1], dtype=torch.int32), fp32.seq_lens[3:4], fp32.scale)
    assert torch.equal(alone[0], together[3])
