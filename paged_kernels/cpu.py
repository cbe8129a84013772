"""The tuned CPU path (attention backend ``"cpu"``): the reference's contract, made fast on a CPU.

Same signatures and results as :mod:`paged_kernels.reference` (the kernel tests compare them), but
vectorised and careful with memory, because a worker without a GPU serves through these functions:

* cache writes are one C call (``csrc/cache_write.c``: a row copy per token and KV head, any strides),
  or one ``index_copy_`` per cache where K/V need a cast or no compiler is there;
* decode rows — memory-bound passes over the whole cached context — run in C
  (``csrc/paged_decode_attention.c``, built by :mod:`paged_kernels.native`), which reads every K/V row
  once straight from the paged cache for all query heads of a KV head: fp32 caches, and bf16 ones
  (widened to fp32 in registers, fp32 softmax and accumulators) on CPUs with native bf16 (see
  :func:`native_bf16`). Where the C kernel is absent (no compiler) or does not apply (bf16 without
  native bf16, fp16, GQA group > 16, head_dim > 256, block_size > 128), decode rows are batched in
  torch: sequences of similar length grouped, K/V gathered into reused per-thread scratch buffers,
  one fp32 SDPA call per group;
* prefill chunks go through the same C kernel where it has its AVX-512 loop (head sizes 64 and
  128), one row per query token: row j of a chunk attends to the first ``seq_len - q_len + j + 1``
  positions, its causal prefix. A prompt's K/V stay in L2 while its rows read them, and on CPUs
  without AMX the kernel ran 2-3x SDPA's CPU flash kernel on prompts of 64-512 tokens, level at
  2,048 (``python benchmarks/cpu_kernels.py --part prefill``). A row's attention is then the same
  arithmetic whether its token was prefilled or decoded, so a recomputed prefill (a resume after a
  fault) repeats it exactly. On a CPU with AMX, bf16 chunks of ``_AMX_MIN_ROWS`` tokens or more run
  on the tile registers (``csrc/amx_prefill_attention.c``: a flash-attention loop, 16 tokens by 32
  keys a step; 2-2.5x SDPA's CPU kernel on chunks of 128-512 tokens), all of a step's in one call
  that packs a cached prefix they share once for all of them, or, where Linux refuses the
  tiles, chunks past ``_SDPA_MIN_PAIRS`` go to SDPA, whose tile GEMMs are 2-4x faster there than a
  row per token. On a CPU with AVX512-BF16 but no AMX the same kernel runs on emulated tiles
  (``csrc/amx_tiles.h``: each tile product as AVX512-BF16 dot products), for chunks of at least
  ``_EMULATED_MIN_ROWS`` tokens and ``_EMULATED_MIN_PAIRS`` (token, position) pairs: 1.5-1.7x the
  row kernel there. Decode rows sharing a cached prefix take the tiles (real or emulated) too.
  Elsewhere (no compiler, no AVX-512, other head sizes) a chunk gathers its sequence's K/V into
  scratch and runs SDPA (causal, ``is_causal`` when the chunk has no cached context) in the cache's
  dtype (bf16 SDPA accumulates in fp32).

:func:`available` tells whether the C kernel is there.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from paged_kernels import native

_KERNEL = "paged_decode_attention"
_MAX_GROUP, _MAX_HEAD_DIM, _MAX_BLOCK_SIZE = 16, 256, 128


# CPU flags whose bf16 arithmetic makes a bf16 model faster than fp32 (vLLM's CPU backend checks the
# same two): AMX tiles (Intel Sapphire Rapids and later), AVX512-BF16 (Cooper Lake, AMD Zen 4 and later).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def native_bf16() -> str | None:
    """The flag of :data:`BF16_CPU_FLAGS` this CPU has (the first listed), or None.

    The one test for "this CPU computes in bf16 natively": ``--dtype auto`` picks bf16 on the CPU
    exactly when it holds, and only then does the C kernel serve bf16 caches (elsewhere bf16 is not
    picked automatically, and a forced bf16 decodes through the torch path).
    """
    flags = native.cpu_flags()
    return next((flag for flag in BF16_CPU_FLAGS if flag in flags), None)


_ENTRY_POINTS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}


_P, _I64, _I32 = native.PTR, native.I64, native.INT
_DECODE_ARGTYPES = [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I64,
                    _I32, _I32, _I32, _I32, _I32, native.FLOAT, _I32, _I32]
_WRITE_ARGTYPES = [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _I64, _I32, _I32, _I32, _I32,
                   _I32]


def _function(dtype: torch.dtype = torch.float32) -> ctypes._CFuncPtr | None:
    if dtype not in _ENTRY_POINTS:
        return None
    return native.function(_KERNEL, _ENTRY_POINTS[dtype], _DECODE_ARGTYPES)


def available() -> bool:
    """Whether the C decode kernel could be built and loaded on this machine."""
    return _function() is not None


def _supported(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    return (
        query.device.type == "cpu"
        and query.dtype == key_cache.dtype == value_cache.dtype
        and (query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and native_bf16() is not None))
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
    """:func:`_decode`'s contract, in C when the inputs allow it (the entry point of their dtype)."""
    fn = _function(query.dtype)
    if fn is None or not _supported(query, key_cache, value_cache) or min(lens) < 1:
        _decode(query, key_cache, value_cache, block_tables, seq_lens, lens, scale, out)
        return
    tables = block_tables.to(torch.int32).contiguous()
    _run(fn, query, key_cache, value_cache, tables, tables.stride(0), seq_lens.to(torch.int32).contiguous(), scale, out,
         tiles=_shares_on_tiles(query.dtype))


def _shares_on_tiles(dtype: torch.dtype) -> bool:
    """Whether decode rows of ``dtype`` sharing a cached prefix attend it on tiles together (AMX, or
    emulated with AVX512-BF16; within bf16 rounding of each alone): bf16 only. bf16 results already
    vary with the batch's GEMM shapes; fp32 ones stay bit-exact."""
    return dtype == torch.bfloat16 and native_bf16() is not None


def _run(fn: ctypes._CFuncPtr, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
         tables: torch.Tensor, table_stride: int, lengths: torch.Tensor, scale: float, out: torch.Tensor, *,
         tiles: bool = False) -> None:
    """One call of the C kernel: row i of ``query`` attends to the first ``lengths[i]`` positions of
    the block table at ``tables`` + i * ``table_stride`` (int32, ``lengths`` too); writes ``out``.
    ``tiles``: bf16 rows that share a cached prefix run it on tiles (AMX, or emulated with
    AVX512-BF16) where the CPU allows."""
    target = out if out.dtype == query.dtype and out.stride(-1) == 1 else torch.empty_like(query)
    num_rows, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    fn(query.data_ptr(), query.stride(0), query.stride(1),
       key_cache.data_ptr(), value_cache.data_ptr(),
       key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
       tables.data_ptr(), table_stride, lengths.data_ptr(),
       target.data_ptr(), target.stride(0), target.stride(1),
       num_rows, num_heads, num_kv_heads, head_dim, block_size, float(scale), torch.get_num_threads(), int(tiles))
    if target is not out:
        out.copy_(target)


def _vectorized(head_dim: int) -> bool:
    """Whether the kernel has its AVX-512 loop for ``head_dim``: a prefill chunk (a row per token, so
    its causal half of the scores one row at a time) is faster than SDPA only there; the plain C loop,
    fine for decode rows, would be far slower than SDPA's GEMMs."""
    fn = native.function(_KERNEL, "paged_decode_attention_vectorized", [native.INT], ctypes.c_int)
    return fn is not None and bool(fn(head_dim))


_AMX_KERNEL = "amx_prefill_attention"
# A tile holds 16 query tokens: below about 8 the rows left empty cost more than a row per token
# (timed against _native_prefill's row kernel on an Intel Xeon with AMX-BF16, 2 threads: 8 rows over
# 1,000 positions 1.3x faster on tiles, 4 rows 0.7x, 2 rows over 500 0.5x).
_AMX_MIN_ROWS = 8
_AMX_ARGTYPES = [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, _I32, _P, _I64, _I64,
                 _I32, _I32, _I32, _I32, native.FLOAT, _I64, _I32]
# One call's packed K/V (its chunks' distinct 32-key blocks, 24 KiB each for SmolLM2's 3 KV heads of
# 64) stays under this: chunks with longer contexts between them go in groups that fit.
_AMX_PACKED_BUDGET = 128 << 20


# With the tiles emulated (AVX512-BF16 without AMX: csrc/amx_tiles.h) a 16-row tile costs its full
# work whatever rows it holds, and a call packs its blocks first: a chunk takes the tiles from 16 rows
# and this many (query row, key position) pairs (python benchmarks/cpu_kernels.py --part tiles, against
# the row kernel on a 2-core AMD EPYC (Zen 5) with AVX512-BF16, one layer of SmolLM2-135M: 16 rows
# over 144 positions 1.17x, 32 over 96 1.07x, 64 x 64 1.23x, 256 x 256 2.15x, 64 over 1,088 2.18x;
# 32 x 32 0.85x, 16 x 16 0.57x, 8 over 1,032 1.03x, 8 over 520 0.92x).
_EMULATED_MIN_ROWS = 16
_EMULATED_MIN_PAIRS = 2048


def tiles_emulated() -> bool:
    """Whether the prefill tile kernel runs on emulated tiles here (AVX512-BF16, no AMX)."""
    fn = native.function(_AMX_KERNEL, "amx_prefill_emulated", [], ctypes.c_int)
    return fn is not None and bool(fn())


def _tile_min_rows() -> int:
    """The fewest rows of a chunk that may take the tiles; shorter chunks go as rows."""
    return _EMULATED_MIN_ROWS if tiles_emulated() else _AMX_MIN_ROWS


def _takes_tiles(q_len: int, seq_len: int) -> bool:
    """Whether a prefill chunk of ``q_len`` rows over ``seq_len`` positions is worth the tiles."""
    if tiles_emulated():
        return q_len >= _EMULATED_MIN_ROWS and q_len * seq_len >= _EMULATED_MIN_PAIRS
    return q_len >= _AMX_MIN_ROWS


def amx_prefill_available(head_dim: int = 64) -> bool:
    """Whether bf16 prefill chunks of ``head_dim`` run on tiles here: the CPU has AMX-BF16 (and Linux
    lets this process use the tile registers) or AVX512-BF16 (the tiles emulated, ``csrc/amx_tiles.h``),
    and the kernel was built for it."""
    if native_bf16() is None:
        return False
    fn = native.function(_AMX_KERNEL, "amx_prefill_available", [_I32], ctypes.c_int)
    return fn is not None and bool(fn(head_dim))


def _amx_applies(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether bf16 chunks of ``query``'s step can run on the tiles at all (dtype, CPU, strides)."""
    return (query.dtype == torch.bfloat16 and native_bf16() is not None and query.device.type == "cpu"
            and out.dtype == torch.bfloat16 and out.stride(-1) == 1 and _supported(query, key_cache, value_cache))


def _amx_prefill_batch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, seqs: list[int], starts: list[int], q_lens: list[int],
                       lens: list[int], scale: float, out: torch.Tensor, *, packed: dict | None = None) -> bool:
    """The prefill chunks of sequences ``seqs`` in one call of the tile kernel
    (``csrc/amx_prefill_attention.c``): sequence ``s``'s chunk is rows ``starts[s]`` to ``starts[s] +
    q_lens[s]`` of ``query`` and ``out``, the last of its ``lens[s]`` positions, read through row ``s``
    of ``block_tables``. A cached prefix the chunks share is packed for the tiles once for all of
    them. False, writing nothing, where the kernel does not apply (see :func:`_amx_prefill`).
    ``packed``: a dict kept for calls with the same tables and chunks (a step's layers), where the
    kernel's int32 arguments are made once."""
    if not seqs or not _amx_applies(query, key_cache, value_cache, out):
        return False
    fn = native.function(_AMX_KERNEL, "amx_prefill_attention_batch", _AMX_ARGTYPES, ctypes.c_int)
    if fn is None:
        return False
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if packed is None:
        packed = {}
    if "tables" not in packed:
        packed["tables"] = block_tables.to(torch.int32).contiguous()
        packed["per_seq"] = torch.tensor([seqs, [lens[s] for s in seqs], [q_lens[s] for s in seqs],
                                          [starts[s] for s in seqs]], dtype=torch.int32)
    tables = packed["tables"]
    rows, seq_lens, chunk_lens, chunk_starts = packed["per_seq"].unbind(0)
    return fn(query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
              key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), tables.data_ptr(), tables.stride(0),
              rows.data_ptr(), seq_lens.data_ptr(), chunk_lens.data_ptr(), chunk_starts.data_ptr(), len(seqs),
              out.data_ptr(), out.stride(0), out.stride(1), num_heads, num_kv_heads, head_dim, block_size,
              float(scale), _AMX_PACKED_BUDGET, torch.get_num_threads()) == 0


def _amx_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_len: int, scale: float, out: torch.Tensor) -> bool:
    """A bf16 chunk's attention on tiles, written into ``out``; False, writing nothing, where it
    does not apply (too short for the tiles: :func:`_takes_tiles`; neither AMX-BF16 nor AVX512-BF16,
    not bf16, head size not 64 or 128, strides it does not take, no permission for the tiles)."""
    q_len = query.shape[0]
    return _takes_tiles(q_len, seq_len) and _amx_prefill_batch(query, key_cache, value_cache, block_table[None],
                                                               [0], [0], [q_len], [seq_len], scale, out)


def _native_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_len: int, scale: float, out: torch.Tensor) -> None:
    """:func:`_prefill`'s contract (same arguments), written into ``out``, in C when the inputs allow
    it: a bf16 chunk on tiles, else one kernel row per query token, each over its causal prefix,
    all rows reading the sequence's one block table."""
    if _amx_prefill(query, key_cache, value_cache, block_table, seq_len, scale, out):
        return
    fn = _function(query.dtype)
    q_len = query.shape[0]
    if (fn is None or not _supported(query, key_cache, value_cache) or not _vectorized(query.shape[2])
            or _sdpa_is_faster(query.dtype, q_len, seq_len)):
        out.copy_(_prefill(query, key_cache, value_cache, block_table, seq_len, scale))
        return
    lengths = torch.arange(seq_len - q_len + 1, seq_len + 1, dtype=torch.int32)
    _run(fn, query, key_cache, value_cache, block_table.to(torch.int32).contiguous(), 0, lengths, scale, out)


# On a CPU with AMX tiles torch's SDPA runs a bf16 chunk's attention as tile GEMMs: past about this
# many (query row, key position) pairs it beats a row per token (python benchmarks/cpu_kernels.py
# --part prefill; Intel Xeon with AMX-BF16, 2 threads: 32 x 256 even, 512 x 512 2.6x, 64 rows over
# 1,088 cached positions 2.5x, 2,048 x 2,048 4.5x; below it the C kernel wins, 64 x 64 by 1.5x).
_SDPA_MIN_PAIRS = 12_288


def _sdpa_is_faster(dtype: torch.dtype, q_len: int, seq_len: int) -> bool:
    """Whether a prefill chunk of ``q_len`` rows over ``seq_len`` positions goes to SDPA rather than
    the C kernel: bf16, on a CPU with AMX, large enough. Such a chunk's rows are no longer the same
    arithmetic as decoded rows (bf16 replay after a fault is not bit-exact anyway: GEMMs of other
    shapes round differently; float32 keeps the C kernel and exact replay)."""
    return dtype == torch.bfloat16 and native_bf16() == "amx_bf16" and q_len * seq_len >= _SDPA_MIN_PAIRS


def _write_function() -> ctypes._CFuncPtr | None:
    return native.function("cache_write", "cache_write", _WRITE_ARGTYPES, native.I64)


def cpu_reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 or int32; -1 = do not store (padding)
) -> None:
    """:func:`paged_kernels.reference.ref_reshape_and_cache`: in C (``csrc/cache_write.c``, one row copy per
    token and head, any strides) when K/V already have the cache's dtype; else one ``index_copy_`` per
    cache (head-major storage: each (head, slot) row is one row of a flat matrix; block-major: one row
    of all heads per slot; other strides: advanced indexing)."""
    write = _write_function()
    if (write is not None and key.dtype == value.dtype == key_cache.dtype == value_cache.dtype
            and key.device.type == "cpu" and key.stride(-1) == value.stride(-1) == key_cache.stride(-1) == 1
            and value_cache.stride() == key_cache.stride()):
        slots = slot_mapping.to(torch.int64).contiguous()
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        bad = write(key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
                    key_cache.data_ptr(), value_cache.data_ptr(),
                    key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                    slots.data_ptr(), slots.shape[0], num_blocks * block_size,
                    num_kv_heads, head_dim, block_size, key.element_size(), torch.get_num_threads())
        if bad:
            raise IndexError(f"{bad} slot(s) of slot_mapping lie past the cache's {num_blocks * block_size} slots")
        return
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    for cache, rows in ((key_cache, key), (value_cache, value)):
        by_head = cache.permute(2, 0, 1, 3)  # [num_kv_heads, num_blocks, block_size, head_dim]
        if by_head.is_contiguous():  # head-major storage: (head, slot) rows of one flat matrix
            flat_rows = _per_head(slots, by_head.shape[0], by_head.shape[1] * block_size)
            by_head.view(-1, cache.shape[3]).index_copy_(
                0, flat_rows, rows.to(cache.dtype).transpose(0, 1).reshape(-1, cache.shape[3])
            )
        elif cache.is_contiguous():  # block-major: one row of all heads per slot
            cache.view(-1, cache.shape[2] * cache.shape[3]).index_copy_(0, slots, rows.to(cache.dtype).flatten(1))
        else:  # advanced indexing on the two leading dims works for any strides
            cache[slots // block_size, slots % block_size] = rows.to(cache.dtype)


def _per_head(index: torch.Tensor, num_kv_heads: int, per_head: int) -> torch.Tensor:
    """``index`` (of slots or blocks) repeated for each KV head, as rows of head-major memory viewed
    flat: head ``h``'s copy is offset by ``h * per_head``; ``[num_kv_heads * len(index)]``."""
    first = torch.arange(0, num_kv_heads * per_head, per_head, device=index.device)
    return (first[:, None] + index.to(torch.int64)).reshape(-1)



DecodeFn = Callable[..., None]


# The key of this module's entry in a step's cache (``step_cache``: see :func:`cpu_paged_attention`).
_PLAN = "cpu_paged_attention"


@dataclass(slots=True)
class _StepPlan:
    """What :func:`_paged_attention` derives from a step's metadata (lists on the host, the decode
    rows' tables and lengths, which chunks go where): the same for every layer, so with a step's
    cache it is built by the first layer's call and read by the others."""

    num_tokens: int
    head_dim: int
    qsl: list[int]
    lens: list[int]
    q_lens: list[int]
    decode_only: bool  # every sequence one decode row: the batched call, no per-sequence work
    row_tables: torch.Tensor | None = None  # the decode rows' block tables, a row per token
    row_seq_lens: torch.Tensor | None = None  # their lengths (in seq_lens' dtype) ...
    row_lens: list[int] = field(default_factory=list)  # ... and as a list
    rows: torch.Tensor | None = None  # their tokens' rows of the query; None: every token is a row
    chunks: list[int] = field(default_factory=list)  # sequences computed as prefill chunks ...
    on_tiles: list[int] = field(default_factory=list)  # ... and of those, the ones long enough for the tiles
    off_tiles: list[int] = field(default_factory=list)  # ... and the others
    amx: dict = field(default_factory=dict)  # _amx_prefill_batch's packed arguments, made once


def _step_plan(query: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor) -> _StepPlan:
    num_seqs = seq_lens.shape[0]
    qsl = query_start_loc.to(device="cpu", dtype=torch.int64).tolist()
    lens = seq_lens.to(device="cpu", dtype=torch.int64).tolist()
    q_lens = [qsl[s + 1] - qsl[s] for s in range(num_seqs)]
    plan = _StepPlan(query.shape[0], query.shape[2], qsl, lens, q_lens, all(n == 1 for n in q_lens))
    if plan.decode_only:
        return plan
    # Decode rows, and chunks too short for the tiles (a decode row with its draft tokens, say) where
    # the C kernel has its AVX-512 loop, go to `decode` together, a row per token: row j of a chunk
    # of n attends to the first seq_len - n + j + 1 positions, through its sequence's block table.
    # One call for all, and rows that share a cached prefix read it together.
    min_rows = _tile_min_rows()
    short_as_rows = any(1 < n < min_rows for n in q_lens) and _vectorized(query.shape[2])
    as_rows = [n == 1 or (short_as_rows and n < min_rows) for n in q_lens]
    row_seqs = [s for s in range(num_seqs) if as_rows[s]]
    if row_seqs:
        seq_of_row = [s for s in row_seqs for _ in range(q_lens[s])]
        plan.row_lens = [lens[s] - q_lens[s] + j + 1 for s in row_seqs for j in range(q_lens[s])]
        plan.row_tables = block_tables.index_select(0, torch.tensor(seq_of_row, device=block_tables.device))
        plan.row_seq_lens = torch.tensor(plan.row_lens, dtype=seq_lens.dtype, device=seq_lens.device)
        if len(row_seqs) < num_seqs:
            plan.rows = torch.tensor([qsl[s] + j for s in row_seqs for j in range(q_lens[s])], device=query.device)
    plan.chunks = [s for s in range(num_seqs) if not as_rows[s]]
    for s in plan.chunks:
        (plan.on_tiles if _takes_tiles(q_lens[s], lens[s]) else plan.off_tiles).append(s)
    return plan


def _paged_attention(
    decode: DecodeFn,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    step_cache: dict | None = None,
) -> torch.Tensor:
    """Attention with decode rows (and, where the C kernel has its AVX-512 loop, chunks of fewer than
    :func:`_tile_min_rows` tokens) handed to ``decode`` (the signature of :func:`_decode`) in one call, a
    row per token; prefill chunks on tiles all in one call (:func:`_amx_prefill_batch`), the
    others one sequence at a time (:func:`_native_prefill`). ``step_cache``: see
    :func:`cpu_paged_attention`."""
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    plan = step_cache.get(_PLAN) if step_cache is not None else None
    if plan is None or plan.num_tokens != query.shape[0] or plan.head_dim != query.shape[2]:
        plan = _step_plan(query, block_tables, query_start_loc, seq_lens)
        if step_cache is not None:
            step_cache[_PLAN] = plan
    lens, q_lens, qsl = plan.lens, plan.q_lens, plan.qsl
    if plan.decode_only:  # pure decode: batched, no per-sequence loop
        decode(query, key_cache, value_cache, block_tables, seq_lens, lens, scale, out)
        return out
    if plan.row_tables is not None:
        if plan.rows is None:  # every token is a row (decode rows and drafts): in place
            decode(query, key_cache, value_cache, plan.row_tables, plan.row_seq_lens, plan.row_lens, scale, out)
            return out
        row_query = query.index_select(0, plan.rows)
        row_out = torch.empty_like(row_query)
        decode(row_query, key_cache, value_cache, plan.row_tables, plan.row_seq_lens, plan.row_lens, scale, row_out)
        out.index_copy_(0, plan.rows, row_out)
    chunks = plan.chunks
    if _amx_prefill_batch(query, key_cache, value_cache, block_tables, plan.on_tiles, qsl, q_lens, lens, scale, out,
                          packed=plan.amx):
        chunks = plan.off_tiles
    for s in chunks:
        _native_prefill(query[qsl[s] : qsl[s + 1]], key_cache, value_cache, block_tables[s], lens[s], scale,
                        out[qsl[s] : qsl[s + 1]])
    return out


class _Scratch(threading.local):
    """Per-thread gather buffers, reused from layer to layer and step to step.

    A decode step gathers tens of megabytes of K/V per layer; allocating that afresh each time costs
    as much as the copy itself (fresh pages fault in). One buffer per role ("key", "value") and
    dtype/device, grown on demand; a gathered view is only valid until the next gather of its role.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, role: str, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        key = (role, like.dtype, like.device)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
                buffer = self.buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel].view(shape)


_scratch = _Scratch()


def _gather(role: str, cache: torch.Tensor, block_ids: torch.Tensor, num_positions: int,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[*block_ids.shape[:-1], num_kv_heads, num_positions, head_dim]`` of cached rows, in ``dtype``.

    One ``index_select`` copy into the reused scratch buffer of ``role`` (plus a cast where ``dtype``
    is not the cache's). With head-major storage (what ``allocate_kv_caches`` uses on the CPU) each (sequence,
    head) comes out as one contiguous ``[num_positions, head_dim]`` matrix, the layout SDPA's CPU
    kernel reads fastest; with block-major storage whole blocks are copied and the head axis is a
    strided view.
    """
    lead = tuple(block_ids.shape[:-1])
    ids = block_ids.reshape(-1)
    by_head = cache.permute(2, 0, 1, 3)  # [num_kv_heads, num_blocks, block_size, head_dim], a view
    num_kv_heads, num_blocks, block_size, head_dim = by_head.shape
    if by_head.is_contiguous():  # head-major storage: one flat gather of (head, block) tiles
        rows = _scratch.get(role, cache, (num_kv_heads, ids.numel(), block_size, head_dim))
        torch.index_select(by_head.reshape(-1, block_size, head_dim), 0, _per_head(ids, num_kv_heads, num_blocks),
                           out=rows.view(-1, block_size, head_dim))
        rows = rows.view(num_kv_heads, *lead, -1, head_dim).movedim(0, -3)
    else:  # block-major (or other) storage: gather whole blocks, heads become a strided axis
        rows = _scratch.get(role, cache, (ids.numel(), block_size, num_kv_heads, head_dim))
        torch.index_select(cache, 0, ids, out=rows)
        rows = rows.view(*lead, -1, num_kv_heads, head_dim).transpose(-3, -2)
    rows = rows[..., :num_positions, :]  # [*lead, num_kv_heads, num_positions, head_dim]
    return rows.to(dtype)


# Decode gathers at most this many bytes of K (and as many of V) per group of sequences, so a large
# batch with long contexts needs bounded scratch memory (256 sequences x 4k tokens would otherwise
# gather gigabytes) at the cost of a few more SDPA calls.
_DECODE_GATHER_BYTES = 32 << 20
# Decode groups sequences of similar context length (sorted), padding each group to its longest; a
# new group starts when padding would exceed this fraction of the group's real context.
_DECODE_PADDING = 0.15


def _decode_groups(lens: list[int], bytes_per_position: int) -> list[list[int]]:
    """Sequence indices in groups of similar length (ascending), each within the gather budget."""
    groups: list[list[int]] = []
    group: list[int] = []
    total = 0
    for s in sorted(range(len(lens)), key=lens.__getitem__):
        n, longest = len(group) + 1, lens[s]
        if group and (longest * n > (1 + _DECODE_PADDING) * (total + longest)
                      or longest * n * bytes_per_position > _DECODE_GATHER_BYTES):
            groups.append(group)
            group, total = [], 0
        group.append(s)
        total += longest
    groups.append(group)
    return groups


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
    """Groups of sequences of similar length at once: K/V gathered and padded to the group's longest.

    The query heads sharing a KV head become SDPA's query-length axis (a decode row's mask is the
    same for all of them), so GQA needs no K/V repeat.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    grouped_query = query.view(num_seqs, num_kv_heads, group_size, head_dim)
    for group in _decode_groups(lens, num_kv_heads * head_dim * key_cache.element_size()):
        n, longest = len(group), lens[group[-1]]
        index = torch.tensor(group, device=query.device)
        block_ids = block_tables.index_select(0, index)[:, : -(-longest // block_size)].long()
        k = _gather("key", key_cache, block_ids, longest)  # [n, num_kv_heads, longest, head_dim]
        v = _gather("value", value_cache, block_ids, longest)
        mask = None
        if lens[group[0]] != longest:
            positions = torch.arange(longest, device=query.device)
            mask = (positions < seq_lens.index_select(0, index)[:, None])[:, None, None, :]  # [n, 1, 1, L]
        o = F.scaled_dot_product_attention(grouped_query.index_select(0, index).float(), k, v,
                                           attn_mask=mask, scale=scale)
        out.index_copy_(0, index, o.reshape(n, num_heads, head_dim).to(out.dtype))


def _prefill(
    query: torch.Tensor,  # [q_len, num_heads, head_dim], the last q_len positions of the sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim], fp32 or bf16
    """One sequence's chunk: contiguous K/V, causal mask offset by the context already cached.

    A chunk with no cached context is plain causal attention (``is_causal``: the kernel skips the
    masked half); SDPA gets a batch axis because its CPU kernel parallelises 4-D inputs better.
    bf16 caches are attended in bf16 (SDPA's CPU kernel keeps scores and sums in fp32), so the K/V
    copy stays half the size; other 16-bit caches in fp32.
    """
    q_len, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    dtype = torch.bfloat16 if key_cache.dtype == torch.bfloat16 else torch.float32
    block_ids = block_table[: -(-seq_len // block_size)].long()
    k = _gather("key", key_cache, block_ids, seq_len, dtype)  # [num_kv_heads, seq_len, head_dim]
    v = _gather("value", value_cache, block_ids, seq_len, dtype)
    # Padded to buckets (zeros, never attended by a real row): see _SDPA_ROW_BUCKET.
    padded_q, padded_kv = _round_up(q_len, _SDPA_ROW_BUCKET), _round_up(seq_len, _SDPA_KEY_BUCKET)
    mask = None
    if q_len != seq_len:
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        key_pos = torch.arange(padded_kv, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, padded_kv]: causal, padding masked
        # rows past the chunk see position 0 alone (a row that sees nothing would be NaN)
        mask = F.pad(mask, (0, 0, 0, padded_q - q_len), value=False)
        mask[q_len:, 0] = True
    elif padded_q != padded_kv:  # no cached context: one bucket for both, plain causal attention
        padded_q = padded_kv = max(padded_q, padded_kv)
    o = F.scaled_dot_product_attention(
        F.pad(query.to(dtype).transpose(0, 1), (0, 0, 0, padded_q - q_len))[None],  # [1, num_heads, padded_q, head_dim]
        F.pad(k, (0, 0, 0, padded_kv - seq_len))[None],
        F.pad(v, (0, 0, 0, padded_kv - seq_len))[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return o[0, :, :q_len].transpose(0, 1)


# SDPA's CPU kernel compiles (oneDNN's brgemm) and keeps a small GEMM per block shape it meets, and a
# chunk's row count and context length decide those shapes: a worker seeing every length kept
# growing (+2.8 % of its memory in 2.5 minutes of random batches, still rising). Queries and keys
# are padded with zeros up to these multiples, so the shapes are few; the padding is never attended
# by a real row (causal, or masked).
_SDPA_ROW_BUCKET, _SDPA_KEY_BUCKET = 32, 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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
    step_cache: dict | None = None,
) -> torch.Tensor:
    """:func:`paged_kernels.reference.ref_paged_attention`, tuned for the CPU (see the module doc).

    Decode rows batched by padding read ``block_tables`` entries past a row's own blocks: they must
    be valid block ids (0, the null block, is fine), and the cache must hold no NaN/inf.
    ``step_cache``: a dict that lives for one step's metadata (``block_tables``, ``query_start_loc``,
    ``seq_lens`` unchanged between the calls that pass it: a step's layers). What the call derives
    from them — host lists, the decode rows' tables, the tile kernel's arguments — is kept there by
    the first call and read by the others (~70-90 µs a layer call otherwise, 2-3 % of a burst's wall
    time on 2 cores).
    """
    del num_splits, max_query_len
    return _paged_attention(_native_decode, query, key_cache, value_cache, block_tables, query_start_loc,
                            seq_lens, scale, out, step_cache)
