"""The CPU path's C kernels alone, on realistic shapes (SmolLM2-135M: 9 query heads, 3 KV heads,
head_dim 64, 30 layers, hidden 576), beside what they replace — the figures benchmarks/README.md
quotes.

- ``decode``: ``paged_kernels.cpu`` decode attention over a 30-layer bf16 cache of 4,369 blocks (as the
  offline benchmark allocates), 32 sequences of 350–650 tokens on shuffled blocks, one call per layer
  as a step makes them. ``--against REV`` also builds ``paged_kernels/csrc/paged_decode_attention.c`` as it
  was at git revision REV and alternates the two in this process (same inputs, same cache). Printed
  beside: ``C read``, a C loop reading exactly the rows the kernel reads in its order (the floor
  under the kernel), and ``plain read``, torch's ``index_select`` copy of the same whole blocks.
- ``prefill``: one sequence's prefill chunk (64, 288, 512 and 2,048 new tokens, no cached context,
  head-major bf16 and fp32 caches on shuffled blocks) through the C kernel, a row per token
  (``paged_kernels.cpu._native_prefill``), against the gather + SDPA it replaced (``paged_kernels.cpu._prefill``);
  then, on a CPU with tiles (AMX, or emulated), a step's 32 chunks after 4 shared cached prefixes in
  one tile-kernel call against a call per chunk.
- ``tiles``: bf16 attention on the tiles (AMX, or emulated with AVX512-BF16: ``csrc/amx_tiles.h``)
  against the row kernel, in one layer: a prefill chunk of 8-512 tokens with and without a cached
  context of 1,024, and decode rows sharing cached prefixes (64 rows over 4 prefixes of 1,024, 16
  and 4 over one) — the figures behind ``paged_kernels.cpu``'s thresholds.
- ``gemm``: a step's 120 decoder-layer GEMMs of SmolLM2-135M (qkv, o, gate/up, down; 30 layers'
  weights, cycled from memory as a step reads them) at 1-2,048 rows through
  ``paged_kernels.small_gemm`` (AMX tiles) against oneDNN on its packed weights
  (``worker_service.models.cpu_gemm.PackedLinear`` without the small path), rounds alternating.
- ``fused``: ``paged_kernels.cpu_fused`` (RMSNorm after its residual add, rotary, SiLU(gate) * up of the
  fused gate/up output) against the torch code of ``worker_service.models`` at 32, 512 and 2,048
  tokens.

Timings are medians of alternating rounds (this host's speed drifts between runs: compare within one).

    python benchmarks/cpu_kernels.py                      # every part
    python benchmarks/cpu_kernels.py --part decode --against 2f39b1b
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paged_kernels import cpu, cpu_fused, native, small_gemm
from worker_service.cpu_memory import tune_malloc, zeros
from worker_service.models.layers import RMSNorm, RotaryEmbedding, apply_rope

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, BLOCK = 9, 3, 64, 576, 16
INTERMEDIATE = 1536


def _timed(fn, repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def _built(files: dict[str, bytes], source: str, symbol: str) -> ctypes._CFuncPtr:
    """``symbol`` of ``source`` (one of ``files``, written to a fresh folder) built with the kernels'
    flags (paged_kernels.native), its types left for the caller to set."""
    folder = Path(tempfile.mkdtemp(prefix="pagedserve-bench-"))
    for name, text in files.items():
        (folder / name).write_bytes(text)
    library = folder / f"{Path(source).stem}.so"
    subprocess.run([os.environ.get("CC", "cc"), *native.FLAGS, "-o", str(library), str(folder / source),
                    *native.LIBS], check=True)
    return getattr(ctypes.CDLL(str(library)), symbol)


def _old_kernel(rev: str, like: ctypes._CFuncPtr) -> ctypes._CFuncPtr:
    """The bf16 entry point of the decode kernel's source at ``rev``, built with today's flags."""
    files = {}
    listed = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:paged_kernels/csrc"],
                            capture_output=True, text=True, check=True).stdout.split()
    for name in ["paged_decode_attention.c", *(n for n in listed if n.endswith(".h"))]:  # the headers it includes
        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:paged_kernels/csrc/{name}"], capture_output=True, check=False)
        if shown.returncode == 0:
            files[name] = shown.stdout
    fn = _built(files, "paged_decode_attention.c", "paged_decode_attention_bf16")
    fn.argtypes, fn.restype = like.argtypes, None
    return fn


# The floor under the kernel: reading the same K/V rows in the same order (items of (sequence, KV head)
# spread over OpenMP threads as the kernel spreads them), XOR-folding them so nothing is skipped.
_READ_SOURCE = r"""
#include <stdint.h>
uint64_t read_rows(const char *k, const char *v, int64_t s_block, int64_t s_tok, int64_t s_head,
                   const int32_t *tables, int64_t bt_stride, const int32_t *lens, int num_seqs, int num_kv_heads,
                   int64_t row_bytes, int block_size, int num_threads) {
    uint64_t fold = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(^ : fold)
    for (int64_t item = 0; item < (int64_t)num_seqs * num_kv_heads; item++) {
        const int s = (int)(item / num_kv_heads), h = (int)(item % num_kv_heads);
        for (int t = 0; t < lens[s]; t++) {
            const int64_t at = (int64_t)tables[s * bt_stride + t / block_size] * s_block + (t % block_size) * s_tok
                               + h * s_head;
            const uint64_t *kr = (const uint64_t *)(k + at), *vr = (const uint64_t *)(v + at);
            for (int64_t i = 0; i < row_bytes / 8; i++) fold ^= kr[i] ^ vr[i];
        }
    }
    return fold;
}
"""


def _read_rows() -> ctypes._CFuncPtr:
    fn = _built({"read.c": _READ_SOURCE.encode()}, "read.c", "read_rows")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, ptr, ctypes.c_int, ctypes.c_int, i64, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_uint64
    return fn


def decode(rounds: int, against: str | None, layers: int = 30, blocks: int = 4369) -> None:
    if blocks < 32 * -(-651 // BLOCK):
        raise SystemExit(f"--blocks must be at least {32 * -(-651 // BLOCK)} (32 sequences of up to 651 tokens)")
    gen = torch.Generator().manual_seed(0)
    # bf16 where the worker runs bf16 (a CPU with native bf16); elsewhere the fp32 kernel it runs there
    dtype = torch.bfloat16 if cpu.native_bf16() is not None else torch.float32
    if dtype == torch.float32:
        print("the C decode kernel has no bf16 path on this machine: decode timed in float32")
    if against and dtype != torch.bfloat16:
        raise SystemExit("--against compares the bf16 entry point, which this machine cannot run")
    esize = torch.empty(0, dtype=dtype).element_size()
    caches = []
    for _ in range(layers):  # head-major memory, the logical [blocks, block, KV heads, head_dim] view
        k, v = (zeros((KV_HEADS, blocks, BLOCK, HEAD_DIM), dtype, torch.device("cpu"), populate=True)
                for _ in range(2))
        k.copy_(torch.randn(k.shape, generator=gen)), v.copy_(torch.randn(v.shape, generator=gen))
        caches.append((k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)))
    lens = torch.randint(350, 651, (32,), generator=gen)
    per_seq = -(-651 // BLOCK)
    tables = torch.randperm(blocks, generator=gen)[: 32 * per_seq].view(32, per_seq).to(torch.int32)
    query = torch.randn(32, HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(query)
    host_lens = lens.tolist()
    kernels = {"now": cpu._function(dtype)}
    if kernels["now"] is None or not cpu._supported(query, *caches[0]):
        raise SystemExit(f"the C decode kernel is not available for {dtype} on this machine")
    if against:
        kernels[against] = _old_kernel(against, kernels["now"])
    real = cpu._function

    def step(fn) -> None:
        cpu._function = lambda dtype=torch.float32: fn
        try:
            for key_cache, value_cache in caches:
                cpu._native_decode(query, key_cache, value_cache, tables, lens, host_lens, HEAD_DIM ** -0.5, out)
        finally:
            cpu._function = real

    results = {}
    for name, fn in kernels.items():
        step(fn)
        results[name] = out.clone()
    if against:
        diff = (results["now"].float() - results[against].float()).abs().max().item()
        print(f"largest difference now vs {against}: {diff:.2e} (bf16 outputs)")
    ids = tables.flatten().long()
    flat = [(k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)) for k, v in caches]

    def read() -> None:
        for k, v in flat:
            k.index_select(1, ids), v.index_select(1, ids)

    read_rows = _read_rows()
    lengths = lens.to(torch.int32)

    def c_read() -> None:
        for k, v in caches:
            read_rows(k.data_ptr(), v.data_ptr(), k.stride(0) * esize, k.stride(1) * esize, k.stride(2) * esize,
                      tables.data_ptr(), tables.stride(0), lengths.data_ptr(), 32, KV_HEADS, HEAD_DIM * esize, BLOCK,
                      torch.get_num_threads())

    times: dict[str, list[float]] = {name: [] for name in [*kernels, "C read", "plain read"]}
    for r in range(rounds):
        order = list(kernels.items()) if r % 2 == 0 else list(reversed(kernels.items()))
        for name, fn in order:
            times[name].append(_timed(lambda fn=fn: step(fn), 5) / layers)
        times["C read"].append(_timed(c_read, 5) / layers)
        times["plain read"].append(_timed(read, 3) / layers)
    cached = sum(host_lens) * KV_HEADS * HEAD_DIM * esize * 2  # K and V bytes attention reads per layer
    read_bytes = ids.numel() * BLOCK * KV_HEADS * HEAD_DIM * esize * 2
    print(f"decode attention ({str(dtype).removeprefix('torch.')}), 32 sequences of {min(host_lens)}-{max(host_lens)} "
          f"tokens, {layers} layers, "
          f"{torch.get_num_threads()} threads, medians of {rounds} rounds:")
    for name, values in times.items():
        moved = read_bytes if name == "plain read" else cached
        ms = statistics.median(values) * 1e3
        print(f"  {name:>12}: {ms:.3f} ms a layer, {moved / ms / 1e6:.1f} GB/s of K/V "
              f"(rounds: {', '.join(f'{v * 1e3:.3f}' for v in values)})")


def prefill(rounds: int) -> None:
    blocks = 256
    gen = torch.Generator().manual_seed(0)
    print(f"prefill attention of one sequence (no cached context), {torch.get_num_threads()} threads, "
          f"medians of {rounds} rounds; GFLOP/s counted over the causal half:")
    for dtype in (torch.bfloat16, torch.float32):
        k, v = (torch.randn(KV_HEADS, blocks, BLOCK, HEAD_DIM, generator=gen).to(dtype).permute(1, 2, 0, 3)
                for _ in range(2))
        if cpu._function(dtype) is None or not cpu._supported(torch.empty(1, HEADS, HEAD_DIM, dtype=dtype), k, v):
            print(f"  {dtype}: the C kernel is not available on this machine")
            continue
        for tokens in (64, 288, 512, 2048):
            table = torch.randperm(blocks, generator=gen)[: -(-tokens // BLOCK)].to(torch.int32)
            query = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
            out = torch.empty_like(query)
            scale = HEAD_DIM ** -0.5
            cases = {"gather + SDPA": functools.partial(cpu._prefill, query, k, v, table, tokens, scale),
                     "C kernel": functools.partial(cpu._native_prefill, query, k, v, table, tokens, scale, out)}
            times = _alternating_medians(rounds, cases, max(2, 4096 // tokens))
            flops = 4 * HEADS * tokens * tokens * HEAD_DIM / 2
            cases["C kernel"]()
            diff = (cases["gather + SDPA"]().float() - out.float()).abs().max().item()
            print(f"  {str(dtype).removeprefix('torch.'):>8} {tokens:>5} tokens: " + ", ".join(
                f"{name} {t * 1e3:.3f} ms ({flops / t / 1e9:.0f} GFLOP/s)"
                for name, t in times.items()) + f"; largest difference {diff:.1e}")


def shared_prefix_step(rounds: int) -> None:
    """A step that prefills 32 chunks of 64 tokens after 4 cached prefixes of 1,024 tokens (8 chunks
    each, sharing the prefix's blocks), bf16 on tiles: one call for the step against one call
    per chunk (each lays out its whole context for the tiles)."""
    if not cpu.amx_prefill_available(HEAD_DIM):
        print("shared-prefix prefill step: no tile kernel on this machine")
        return
    gen = torch.Generator().manual_seed(1)
    chunks, new, prefix = 32, 64, 1024
    per_seq = (prefix + new) // BLOCK
    blocks = 4 * prefix // BLOCK + chunks * (new // BLOCK) + 8
    k, v = (torch.randn(KV_HEADS, blocks, BLOCK, HEAD_DIM, generator=gen).to(torch.bfloat16).permute(1, 2, 0, 3)
            for _ in range(2))
    order = torch.randperm(blocks, generator=gen).to(torch.int32)
    prefixes = order[: 4 * prefix // BLOCK].view(4, prefix // BLOCK)
    tails = order[4 * prefix // BLOCK:][: chunks * (new // BLOCK)].view(chunks, new // BLOCK)
    tables = torch.cat([prefixes[torch.arange(chunks) % 4], tails], dim=1)  # [chunks, per_seq]
    assert tables.shape[1] == per_seq
    query = torch.randn(chunks * new, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(query)
    starts, q_lens, lens = [s * new for s in range(chunks + 1)], [new] * chunks, [prefix + new] * chunks
    scale = HEAD_DIM ** -0.5

    def one_call() -> None:
        cpu._amx_prefill_batch(query, k, v, tables, list(range(chunks)), starts, q_lens, lens, scale, out)

    def per_chunk() -> None:
        for s in range(chunks):
            rows = slice(starts[s], starts[s + 1])
            cpu._amx_prefill(query[rows], k, v, tables[s], lens[s], scale, out[rows])

    times = _alternating_medians(rounds, {"one call per chunk": per_chunk, "one call for the step": one_call}, 4)
    print(f"shared-prefix prefill step (one layer: {chunks} chunks of {new} tokens after 4 cached prefixes of "
          f"{prefix}), bf16 on tiles: " + ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in times.items()))


def _alternating_medians(rounds: int, cases: dict, repeat: int) -> dict[str, float]:
    """Each case's median seconds a call (``repeat`` calls a round), the cases taken in turn, their
    order reversed every other round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name, fn in (list(cases.items()) if r % 2 == 0 else list(reversed(cases.items()))):
            times[name].append(_timed(fn, repeat))
    return {name: statistics.median(t) for name, t in times.items()}


def tiles(rounds: int) -> None:
    """bf16 attention on the tiles against the row kernel (``paged_kernels.cpu``'s thresholds)."""
    if not cpu.amx_prefill_available(HEAD_DIM):
        print("tiles: no tile kernel (AMX-BF16 or AVX512-BF16) on this machine")
        return
    gen = torch.Generator().manual_seed(2)
    blocks = 8192
    k, v = (torch.randn(KV_HEADS, blocks, BLOCK, HEAD_DIM, generator=gen).to(torch.bfloat16).permute(1, 2, 0, 3)
            for _ in range(2))
    scale = HEAD_DIM ** -0.5
    fn = cpu._function(torch.bfloat16)
    kind = "emulated with AVX512-BF16" if cpu.tiles_emulated() else "AMX"
    print(f"bf16 attention on tiles ({kind}) against the row kernel, one layer, {torch.get_num_threads()} threads, "
          f"medians of {rounds} rounds:")
    for q_len, ctx in [(8, 0), (16, 0), (32, 0), (64, 0), (256, 0), (512, 0), (8, 256), (8, 512), (8, 1024),
                       (16, 128), (16, 256), (16, 1024), (32, 64), (32, 128), (64, 1024)]:
        seq_len = ctx + q_len
        table = torch.randperm(blocks, generator=gen)[: -(-seq_len // BLOCK)].to(torch.int32)
        query = torch.randn(q_len, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        out = torch.empty_like(query)
        lengths = torch.arange(ctx + 1, seq_len + 1, dtype=torch.int32)
        t = _alternating_medians(rounds, {
            "rows": lambda: cpu._run(fn, query, k, v, table, 0, lengths, scale, out),
            "tiles": lambda: cpu._amx_prefill_batch(query, k, v, table[None], [0], [0], [q_len], [seq_len], scale, out),
        }, 10)
        print(f"  prefill chunk of {q_len:>3} tokens after {ctx:>4} cached: rows {t['rows'] * 1e3:.3f} ms, "
              f"tiles {t['tiles'] * 1e3:.3f} ms ({t['rows'] / t['tiles']:.2f}x)")
    for num_seqs, prefixes in [(64, 4), (16, 1), (4, 1)]:
        prefix = 1024
        shared = torch.randperm(blocks, generator=gen)[: prefixes * prefix // BLOCK].view(prefixes, -1)
        tails = torch.randperm(blocks, generator=gen)[: num_seqs * 4].view(num_seqs, 4)
        tables = torch.cat([shared[torch.arange(num_seqs) % prefixes], tails], 1).to(torch.int32).contiguous()
        lens = torch.full((num_seqs,), prefix + 40, dtype=torch.int32)
        query = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        out = torch.empty_like(query)
        t = _alternating_medians(rounds, {
            name: functools.partial(cpu._run, fn, query, k, v, tables, tables.stride(0), lens, scale, out, tiles=on)
            for name, on in (("rows", False), ("tiles", True))}, 10)
        print(f"  {num_seqs:>2} decode rows over {prefixes} shared prefix(es) of {prefix}: "
              f"rows {t['rows'] * 1e3:.3f} ms, tiles {t['tiles'] * 1e3:.3f} ms ({t['rows'] / t['tiles']:.2f}x)")


def _fused_times(tokens: int, norm: RMSNorm, rope: RotaryEmbedding, gen: torch.Generator,
                 rounds: int) -> dict[str, float]:
    """Median seconds of each op at ``tokens`` tokens."""
    x = torch.randn(tokens, HIDDEN, generator=gen) * 3
    y = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, rope.cos.shape[0], (tokens,), generator=gen)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(torch.bfloat16)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM)
    cos, sin = rope.cos[positions][:, None], rope.sin[positions][:, None]
    gate_up = (torch.randn(tokens, 2 * INTERMEDIATE, generator=gen) * 3).to(torch.bfloat16)
    gate, up = gate_up.split(INTERMEDIATE, dim=-1)  # the model's views of the GEMM output

    def torch_norm(h: torch.Tensor) -> torch.Tensor:  # RMSNorm's torch code, as the model ran it before
        h = h.float()
        return norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)).to(torch.bfloat16)

    cases = {
        "add + RMSNorm, torch": lambda: torch_norm(x + y),
        "add + RMSNorm, fused": lambda: cpu_fused.rms_norm(x.clone(), norm.weight, norm.eps, residual=y),
        "(the clone above)": lambda: x.clone(),
        "rotary, torch": lambda: apply_rope(qk, cos, sin),
        "rotary, fused": lambda: cpu_fused.rope_(qk, positions, rope.cos, rope.sin),
        "SiLU*up, torch": lambda: F.silu(gate) * up,
        "SiLU*up, fused": lambda: cpu_fused.silu_mul(gate_up),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(_timed(fn, 50))
    return {name: statistics.median(values) for name, values in times.items()}


def fused(rounds: int) -> None:
    if not cpu_fused.available():
        raise SystemExit("the fused ops are not available on this machine")
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(HIDDEN, 1e-5)
    norm.weight.data = torch.randn(HIDDEN, generator=gen)
    norm = norm.to(torch.bfloat16)
    rope = RotaryEmbedding(1.0 / 100000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM), 8192)
    print(f"fused bf16 ops against the torch code, {torch.get_num_threads()} threads, medians of {rounds} rounds (ms):")
    with torch.inference_mode():
        for tokens in (32, 512, 2048):
            times = _fused_times(tokens, norm, rope, gen, rounds)
            print(f"  {tokens:>5} tokens: " + ", ".join(f"{name} {t * 1e3:.3f}" for name, t in times.items()))


def gemm(rounds: int, layers: int = 30) -> None:
    if not small_gemm.available():
        raise SystemExit("the small-batch GEMM needs AMX-BF16 tiles, which this machine does not have")
    from worker_service.models.cpu_gemm import PackedLinear

    gen = torch.Generator().manual_seed(0)
    shapes = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
              (HIDDEN, INTERMEDIATE)]
    weights = [[(torch.randn(o, i, generator=gen) / i**0.5).to(torch.bfloat16) for o, i in shapes]
               for _ in range(layers)]
    onednn = [[PackedLinear(w) for w in layer] for layer in weights]
    tiles = [[small_gemm.pack(w) for w in layer] for layer in weights]
    del weights
    print(f"a step's {4 * layers} layer GEMMs (bf16, weights cycled from memory), "
          f"{torch.get_num_threads()} threads, medians of {rounds} rounds (ms):")
    with torch.inference_mode():
        for rows in (1, 8, 16, 64, 128, 224, 512, 1024, 2048):
            xs = {i: torch.randn(rows, i, generator=gen).to(torch.bfloat16) for i in (HIDDEN, INTERMEDIATE)}

            def with_onednn() -> None:
                for layer in onednn:
                    for linear, (_, i) in zip(layer, shapes):
                        linear(xs[i])

            def with_tiles() -> None:
                for layer in tiles:
                    for packed, (o, i) in zip(layer, shapes):
                        small_gemm.linear(xs[i], packed, o)

            times: dict[str, list[float]] = {"oneDNN": [], "AMX small GEMM": []}
            for _ in range(rounds):
                times["oneDNN"].append(_timed(with_onednn, 5))
                times["AMX small GEMM"].append(_timed(with_tiles, 5))
            print(f"  {rows:>4} rows: " + ", ".join(f"{name} {statistics.median(t) * 1e3:.2f}"
                                                   for name, t in times.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["decode", "prefill", "tiles", "gemm", "fused", "all"], default="all")
    parser.add_argument("--against", metavar="REV", help="also time the decode kernel's source at this git revision")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30, help="decode: cache layers (SmolLM2-135M has 30)")
    parser.add_argument("--blocks", type=int, default=4369, help="decode: cache blocks per layer (at least 1,312)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_malloc()  # as the worker runs
    print(f"load average at start {os.getloadavg()}")
    if args.part in ("decode", "all"):
        decode(args.rounds, args.against, args.layers, args.blocks)
    if args.part in ("prefill", "all"):
        prefill(args.rounds)
        shared_prefix_step(args.rounds)
    if args.part in ("tiles", "all"):
        tiles(args.rounds)
    if args.part in ("gemm", "all") and small_gemm.available():
        gemm(args.rounds, args.layers)
    if args.part in ("fused", "all"):
        fused(args.rounds)
    print(f"load average at end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
