"""The tuned CPU path (``paged_kernels.cpu``: vectorised torch + the C decode kernel) against the plain
torch reference, and the C kernel's build and fallback."""

from __future__ import annotations

import pytest
import torch

from paged_kernels import cpu, native
from paged_kernels.reference import ref_paged_attention, ref_reshape_and_cache

pytestmark = pytest.mark.kernel

needs_native = pytest.mark.skipif(not cpu.available(), reason="no C compiler on this machine")
# Prefill chunks take the C kernel only with its AVX-512 loop (elsewhere SDPA: see
# test_prefill_chunks_take_the_kernel_only_with_its_avx512_loop, which runs everywhere)
needs_prefill_kernel = pytest.mark.skipif(not (cpu.available() and cpu._vectorized(64)),
                                          reason="this CPU's build has no AVX-512 loop: prefill chunks go to SDPA")

MIXED = dict(q_lens=[1, 7, 1, 20, 1], seq_lens=[150, 7, 37, 90, 1])
DECODE = dict(q_lens=[1] * 6, seq_lens=[150, 37, 1, 64, 16, 17])


@pytest.fixture
def bf16_cpu(monkeypatch):
    """A CPU with native bf16 (AVX512-BF16), whatever this one has: the C kernel's bf16 entry point
    is plain C, so it runs anywhere; the flag only decides whether it is used. The row kernel alone:
    no chunk and no shared prefix on tiles (test_kernel_amx.py tests those)."""
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(cpu, "_shares_on_tiles", lambda dtype: False)
    monkeypatch.setattr(cpu, "_takes_tiles", lambda q_len, seq_len: False)


@pytest.fixture
def no_bf16_cpu(monkeypatch):
    """A CPU without AMX-BF16 or AVX512-BF16."""
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse2", "avx2", "avx512f"}))


# bf16 results are rounded once, to bf16 (8 significant bits), from the same fp32 arithmetic
TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@needs_native
@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # two specialised sizes and the generic loop
@pytest.mark.parametrize("block_size", [4, 16, 32])  # 32: a block holds two 16-token tiles
@pytest.mark.parametrize("head_major", [False, True], ids=["block-major", "head-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_attention_matches_reference(paged_batch, bf16_cpu, shape, gqa, head_dim, block_size, head_major,
                                         dtype):
    batch = paged_batch(**shape, num_heads=2 * gqa, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                        head_major=head_major, dtype=dtype)

    out = cpu.cpu_paged_attention(*batch.args())

    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_paged_attention(*batch.args()).float(), **TOLERANCE[dtype])


@needs_native
@pytest.mark.parametrize("gqa", [4, 5])  # 4: the widest group whose accumulators stay in registers
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_chunks_ending_inside_a_block_match_the_reference(paged_batch, bf16_cpu, gqa, head_dim, dtype):
    """The kernel scores up to 128 cached tokens before their softmax: with 24-token blocks a chunk
    ends inside a block (128 = 5 * 24 + 8), and sequences of 127-300 tokens end on both sides of it."""
    batch = paged_batch(q_lens=[1] * 6, seq_lens=[300, 129, 128, 127, 152, 1], num_heads=2 * gqa, num_kv_heads=2,
                        head_dim=head_dim, block_size=24, head_major=True, dtype=dtype)

    out = cpu.cpu_paged_attention(*batch.args())

    torch.testing.assert_close(out.float(), ref_paged_attention(*batch.args()).float(), **TOLERANCE[dtype])


@needs_native
def test_cpu_attention_reads_strided_query_and_writes_into_out(paged_batch):
    batch = paged_batch(**DECODE, num_heads=6, num_kv_heads=2, head_dim=64, head_major=True)
    wide = torch.randn(batch.query.shape[0], 3 * 6, 64)
    wide[:, 6:12] = batch.query  # the query as a strided slice, as a fused QKV projection leaves it
    query = wide[:, 6:12]
    out = torch.full_like(batch.query, float("nan"))
    args = (query, *batch.args()[1:])

    returned = cpu.cpu_paged_attention(*args, out=out)

    assert returned is out
    torch.testing.assert_close(out, ref_paged_attention(*batch.args()), atol=2e-6, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("torch_path, shape", [("_decode", DECODE),
                                               pytest.param("_prefill", MIXED, marks=needs_prefill_kernel)],
                         ids=["decode-rows", "prefill-chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_attention_uses_the_kernel(paged_batch, monkeypatch, bf16_cpu, torch_path, shape, dtype):
    def refused(*args, **kwargs):
        raise AssertionError(f"{torch_path} (the torch path) must not run where the C kernel applies")

    monkeypatch.setattr(cpu, torch_path, refused)
    batch = paged_batch(**shape, num_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype)

    out = cpu.cpu_paged_attention(*batch.args())

    torch.testing.assert_close(out.float(), ref_paged_attention(*batch.args()).float(), **TOLERANCE[dtype])


@needs_prefill_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_prefilled_equals_the_row_decoded(paged_batch, bf16_cpu, dtype):
    """A resume recomputes delivered tokens in a prefill chunk: each row's attention comes out bit
    for bit as when its token was decoded (one row, its causal prefix of the cache)."""
    batch = paged_batch(q_lens=[40, 1], seq_lens=[300, 170], num_heads=6, num_kv_heads=2, head_dim=64,
                        block_size=16, head_major=True, dtype=dtype)
    prefilled = cpu.cpu_paged_attention(*batch.args())

    for j in (0, 17, 39):  # row j of the chunk sees the first 300 - 40 + j + 1 positions
        decoded = cpu.cpu_paged_attention(
            batch.query[j: j + 1], batch.key_cache, batch.value_cache, batch.block_tables[:1],
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([261 + j], dtype=torch.int32), batch.scale)
        assert torch.equal(decoded[0], prefilled[j])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_sharing_a_prefix_come_out_as_each_alone(paged_batch, bf16_cpu, dtype):
    """Sequences that share their first blocks (a cached prompt prefix) are one work item that reads
    each shared block once for all of them: 21 of them (more than one group of 16), of several
    lengths, with a tail of their own past the shared blocks, among rows sharing nothing. Each row
    comes out bit for bit as when it is attended alone, and as the reference says."""
    lens = [300, 129, 305, 40, 256, 277, 131, 250, 300, 301, 302, 303, 304, 290, 280, 270, 260, 259, 258, 257, 299]
    batch = paged_batch(q_lens=[1] * (len(lens) + 3), seq_lens=[*lens, 90, 17, 300], num_heads=6, num_kv_heads=2,
                        head_dim=64, block_size=16, head_major=True, dtype=dtype, num_blocks=1300)
    tables = batch.block_tables
    tables[1:len(lens)] = tables[0]  # the same blocks as row 0 ...
    for s, n in enumerate(lens[1:], start=1):  # ... up to the last full block of a 128-token prefix
        tail = torch.arange(0, max(0, -(-n // 16) - 8), dtype=torch.int32) + 900 + 16 * s
        tables[s, 8:8 + len(tail)] = tail

    together = cpu.cpu_paged_attention(*batch.args())

    for s in range(len(lens) + 3):
        alone = cpu.cpu_paged_attention(
            batch.query[s:s + 1], batch.key_cache, batch.value_cache, tables[s:s + 1],
            torch.tensor([0, 1], dtype=torch.int32), batch.seq_lens[s:s + 1], batch.scale)
        assert torch.equal(alone[0], together[s]), s
    torch.testing.assert_close(together.float(), ref_paged_attention(*batch.args()).float(), **TOLERANCE[dtype])


@needs_prefill_kernel
def test_decode_rows_and_short_chunks_go_to_the_kernel_in_one_call(paged_batch, monkeypatch):
    """A step of decode rows and chunks of 2-7 tokens (decode rows with their draft tokens) is one
    call of the row kernel, a row per token over its causal prefix: each row bit for bit what its
    sequence gets alone (fp32), and what the reference says."""
    calls = []
    decode = cpu._native_decode
    monkeypatch.setattr(cpu, "_native_decode", lambda *args: calls.append(args[5]) or decode(*args))
    batch = paged_batch(q_lens=[1, 4, 2, 1, 7, 3], seq_lens=[150, 90, 37, 1, 200, 3], num_heads=6, num_kv_heads=2,
                        head_dim=64, block_size=16, head_major=True)

    together = cpu.cpu_paged_attention(*batch.args())

    assert calls[0] == [150, 87, 88, 89, 90, 36, 37, 1, 194, 195, 196, 197, 198, 199, 200, 1, 2, 3]  # row lengths
    assert len(calls) == 1
    qsl = batch.query_start_loc.tolist()
    for s in range(6):
        alone = cpu.cpu_paged_attention(
            batch.query[qsl[s]:qsl[s + 1]], batch.key_cache, batch.value_cache, batch.block_tables[s:s + 1],
            torch.tensor([0, qsl[s + 1] - qsl[s]], dtype=torch.int32), batch.seq_lens[s:s + 1], batch.scale)
        assert torch.equal(alone, together[qsl[s]:qsl[s + 1]]), s
    torch.testing.assert_close(together, ref_paged_attention(*batch.args()), **TOLERANCE[torch.float32])


@needs_prefill_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_with_amx_but_no_tile_kernel_long_bf16_chunks_go_to_sdpa(paged_batch, monkeypatch, dtype):
    """On a CPU with AMX whose tile kernel cannot run (Linux refused the tile registers, say),
    SDPA's tile GEMMs beat a row per token past _SDPA_MIN_PAIRS: bf16 chunks that large go there
    (and still match the reference); short ones, decode rows and fp32 stay in C."""
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    monkeypatch.setattr(cpu, "_amx_prefill_batch", lambda *args, **kwargs: False)
    sdpa_rows = []
    sdpa = cpu._prefill
    monkeypatch.setattr(cpu, "_prefill", lambda *args: sdpa_rows.append(args[0].shape[0]) or sdpa(*args))
    # chunks: 100 rows over 300 positions (30,000 pairs), 8 rows over 40 (320 pairs); one decode row
    batch = paged_batch(q_lens=[100, 8, 1], seq_lens=[300, 40, 77], num_heads=6, num_kv_heads=2, head_dim=64,
                        block_size=16, head_major=True, dtype=dtype)

    out = cpu.cpu_paged_attention(*batch.args())

    assert sdpa_rows == ([100] if dtype == torch.bfloat16 else [])
    torch.testing.assert_close(out.float(), ref_paged_attention(*batch.args()).float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_decode_without_native_bf16_takes_the_torch_path(paged_batch, monkeypatch, no_bf16_cpu, dtype):
    calls = []
    torch_decode = cpu._decode
    monkeypatch.setattr(cpu, "_decode", lambda *args: calls.append(args) or torch_decode(*args))
    batch = paged_batch(**DECODE, num_heads=4, num_kv_heads=2, dtype=dtype)

    out = cpu.cpu_paged_attention(*batch.args())

    assert calls, "without native bf16 (or for fp16) the C kernel must not serve 16-bit caches"
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref_paged_attention(*batch.args()))


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    for flags, expected in [({"avx512f", "avx512_bf16"}, "avx512_bf16"), ({"amx_bf16", "avx512_bf16"}, "amx_bf16"),
                            ({"avx2", "avx512f"}, None), (set(), None)]:
        monkeypatch.setattr(native, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert cpu.native_bf16() == expected


def test_cpu_flags_parse_the_flags_line(monkeypatch):
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags\t\t: fpu sse2 avx512_bf16 amx_tile\n")
    assert native.cpu_flags() == {"fpu", "sse2", "avx512_bf16", "amx_tile"}
    monkeypatch.setattr(native, "_cpu_flags", lambda: "")
    assert native.cpu_flags() == frozenset()


def test_without_a_compiler_the_cpu_path_decodes_in_torch(paged_batch, monkeypatch, tmp_path, caplog):
    from paged_kernels import get_attention_ops

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-xyz")

    assert not cpu.available()
    assert "no C compiler" in caplog.text
    assert get_attention_ops("cpu").backend == "cpu"
    batch = paged_batch(**MIXED)
    torch.testing.assert_close(cpu.cpu_paged_attention(*batch.args()), ref_paged_attention(*batch.args()))


def test_native_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("PAGEDSERVE_NATIVE_KERNELS", "0")

    assert native.load("paged_decode_attention") is None


@needs_native
def test_native_build_is_cached_per_source_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))

    first = native.build("paged_decode_attention")
    mtime = first.stat().st_mtime_ns
    again = native.build("paged_decode_attention")

    assert again == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert first.parent == tmp_path and first.name.startswith("paged_decode_attention-")
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : another cpu")
    assert native.library_path("paged_decode_attention") != first  # -march=native code is per CPU


def test_native_build_reports_compiler_errors(monkeypatch, tmp_path):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "broken.c").write_text("int f( {\n")
    monkeypatch.setattr(native, "CSRC", csrc)
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    if not cpu.available():
        pytest.skip("no C compiler on this machine")

    with pytest.raises(native.NativeBuildError, match="broken.c"):
        native.build("broken")
    assert list((tmp_path / "cache").iterdir()) == []  # no half-written library left behind


def _native_flags() -> frozenset[str]:
    """What the compiler targets with -march=native on this machine."""
    import shutil
    import subprocess

    cc = shutil.which("cc")
    if cc is None:
        return frozenset()
    out = subprocess.run([cc, "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                         text=True, check=False).stdout
    return frozenset(line.split()[1] for line in out.splitlines() if line.startswith("#define __"))


@needs_native
@pytest.mark.parametrize("extra, needs", [
    ("-mno-avx512f", "__AVX512F__"),  # the plain C loop, as on a CPU without AVX-512
    ("-mno-avx512bf16", "__AVX512BF16__"),  # AVX-512 without bf16 dot products: bf16 widened to fp32
], ids=["plain-c", "avx512-without-bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_compiled_decode_loop_matches_the_reference(paged_batch, bf16_cpu, monkeypatch, tmp_path, extra,
                                                          needs, dtype):
    """This machine's build takes the fastest loop its CPU has; the others are built here with a
    feature switched off, so they are tested on this machine too."""
    if needs not in _native_flags():
        pytest.skip(f"this machine's build has no {needs} to switch off: its default build is this loop")
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + (extra,))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    batch = paged_batch(**DECODE, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, head_major=True,
                        dtype=dtype)

    out = cpu.cpu_paged_attention(*batch.args())

    assert [p.name for p in tmp_path.iterdir()][0].startswith("paged_decode_attention-")  # built with `extra`
    torch.testing.assert_close(out.float(), ref_paged_attention(*batch.args()).float(), **TOLERANCE[dtype])


@needs_native
@pytest.mark.parametrize("extra", [(), ("-mno-avx512f",)], ids=["this-build", "plain-c-build"])
def test_prefill_chunks_take_the_kernel_only_with_its_avx512_loop(paged_batch, monkeypatch, tmp_path, extra):
    """Row by row, a prefill chunk beats SDPA only in the AVX-512 loop; a build without it (as on a
    CPU without AVX-512) leaves prefill to SDPA and keeps the C kernel for decode rows."""
    prefill_in_c = not extra and "__AVX512F__" in _native_flags()
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + extra)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    sdpa_calls = []
    sdpa = cpu._prefill
    monkeypatch.setattr(cpu, "_prefill", lambda *args: sdpa_calls.append(args[0].shape[0]) or sdpa(*args))
    batch = paged_batch(**MIXED, num_heads=6, num_kv_heads=2, head_dim=64, head_major=True)

    out = cpu.cpu_paged_attention(*batch.args())

    assert sdpa_calls == ([] if prefill_in_c else [7, 20])  # MIXED's two prefill chunks
    torch.testing.assert_close(out, ref_paged_attention(*batch.args()), **TOLERANCE[torch.float32])


@pytest.fixture
def torch_decode(monkeypatch):
    """The CPU path as on a machine without a C compiler: decode rows batched in torch."""
    monkeypatch.setattr(cpu, "_function", lambda dtype=None: None)


@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_major", [False, True], ids=["block-major", "head-major"])
def test_torch_decode_path_matches_reference(paged_batch, torch_decode, shape, gqa, dtype, head_major):
    batch = paged_batch(**shape, num_heads=2 * gqa, num_kv_heads=2, head_dim=32, dtype=dtype, head_major=head_major)

    out = cpu.cpu_paged_attention(*batch.args())

    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref_paged_attention(*batch.args()).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["c", "torch"])
def test_cpu_reshape_and_cache_matches_reference(storage, empty_cache, dtype, path, monkeypatch):
    if path == "torch":
        monkeypatch.setattr(cpu, "_write_function", lambda: None)
    elif not cpu._write_function():
        pytest.skip("no C compiler on this machine")
    num_kv_heads, head_dim = 2, 16  # empty_cache's defaults

    key, value = torch.randn(5, num_kv_heads, head_dim).to(dtype), torch.randn(5, num_kv_heads, head_dim).to(dtype)
    slot_mapping = torch.tensor([13, -1, 0, 31, 6])
    caches = [empty_cache(storage).to(dtype) for _ in range(4)]

    cpu.cpu_reshape_and_cache(key, value, caches[0], caches[1], slot_mapping)
    ref_reshape_and_cache(key, value, caches[2], caches[3], slot_mapping)

    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("num_tokens", [3, 300])  # 300: the multi-threaded loop
def test_cache_write_takes_k_and_v_as_views_of_a_fused_qkv(empty_cache, num_tokens):
    num_kv_heads, head_dim, block_size = 2, 16, 4
    num_blocks = -(-num_tokens // block_size) + 2
    qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim).to(torch.bfloat16)
    key = qkv[:, 4 * head_dim: (4 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, (4 + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    caches = [empty_cache("head-major", num_blocks=num_blocks).to(torch.bfloat16) for _ in range(4)]

    cpu.cpu_reshape_and_cache(key, value, caches[0], caches[1], slots.to(torch.int32))
    ref_reshape_and_cache(key, value, caches[2], caches[3], slots)

    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_cache_write_refuses_slots_past_the_cache(empty_cache):
    cache = [empty_cache("head-major") for _ in range(2)]  # 8 blocks of 4: slots 0..31
    rows = torch.randn(2, 2, 16)
    with pytest.raises(IndexError, match="1 slot"):
        cpu.cpu_reshape_and_cache(rows, rows, *cache, torch.tensor([3, 32]))


def test_cache_write_casts_k_and_v_of_another_dtype(empty_cache):
    caches = [empty_cache("head-major").to(torch.bfloat16) for _ in range(4)]
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)  # fp32 into a bf16 cache: the torch path casts
    slots = torch.tensor([1, 9, 30])

    cpu.cpu_reshape_and_cache(key, value, caches[0], caches[1], slots)
    ref_reshape_and_cache(key, value, caches[2], caches[3], slots)

    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_torch_decode_handles_more_sequences_than_one_gather_holds(paged_batch, monkeypatch, torch_decode):
    monkeypatch.setattr(cpu, "_DECODE_GATHER_BYTES", 1)  # one sequence per group
    batch = paged_batch(**DECODE, num_heads=6)

    out = cpu.cpu_paged_attention(*batch.args())

    torch.testing.assert_close(out, ref_paged_attention(*batch.args()), atol=1e-5, rtol=1e-5)


def test_decode_groups_sort_by_length_and_bound_padding():
    from paged_kernels.cpu import _DECODE_PADDING, _decode_groups

    lens = [500, 3, 40, 480, 41, 39, 1, 510, 100]
    groups = _decode_groups(lens, bytes_per_position=1)

    assert sorted(s for g in groups for s in g) == list(range(len(lens)))
    flat = [lens[s] for g in groups for s in g]
    assert flat == sorted(lens)
    for g in groups:
        longest, total = max(lens[s] for s in g), sum(lens[s] for s in g)
        assert len(g) == 1 or longest * len(g) <= (1 + _DECODE_PADDING) * total
    assert [lens[s] for s in groups[-1]] == [480, 500, 510]  # the long ones share one gather


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [MIXED, DECODE, dict(q_lens=[100, 8, 3, 1], seq_lens=[300, 40, 77, 9])],
                         ids=["mixed", "decode", "chunks"])
def test_a_steps_layers_share_one_plan_through_the_step_cache(paged_batch, dtype, shape):
    """Calls with one step's metadata and one ``step_cache`` (a step's layers: each its own query
    and cache) build what they derive from the metadata once, and each still gets its own result."""
    layers = [paged_batch(**shape, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, head_major=True,
                          dtype=dtype, seed=seed) for seed in (4, 5, 6)]
    meta = layers[0].args()[3:]  # block tables, query_start_loc, seq_lens, scale
    step_cache: dict = {}
    plans = []
    for layer in layers:
        args = (*layer.args()[:3], *meta)
        out = cpu.cpu_paged_attention(*args, step_cache=step_cache)
        torch.testing.assert_close(out.float(), ref_paged_attention(*args).float(), **TOLERANCE[dtype])
        plans.append(step_cache[cpu._PLAN])
    assert plans[0] is plans[1] is plans[2]
    assert list(step_cache) == [cpu._PLAN]


def test_gathers_reuse_scratch_between_calls(paged_batch, torch_decode):
    """Two calls in a row (as two layers of one step) each see their own cache, not stale scratch."""
    first = paged_batch(**DECODE, head_major=True, seed=1)
    second = paged_batch(**DECODE, head_major=True, seed=2)

    out_first = cpu.cpu_paged_attention(*first.args()).clone()
    out_second = cpu.cpu_paged_attention(*second.args())

    torch.testing.assert_close(out_first, ref_paged_attention(*first.args()), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_second, ref_paged_attention(*second.args()), atol=1e-5, rtol=1e-5)


def test_scratch_works_in_and_out_of_inference_mode(paged_batch, torch_decode):
    """The model runner calls the CPU path under ``torch.inference_mode``, tests call it outside:
    the reused gather buffers must serve both, in either order."""
    batch = paged_batch(**MIXED, head_major=True, seed=3)
    expected = ref_paged_attention(*batch.args())
    with torch.inference_mode():
        inside = cpu.cpu_paged_attention(*batch.args())
    outside = cpu.cpu_paged_attention(*batch.args())
    torch.testing.assert_close(inside, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outside, expected, atol=1e-5, rtol=1e-5)


@needs_native
def test_loading_the_kernel_leaves_the_process_floating_point_state_alone():
    """A -ffast-math shared object would turn on flush-to-zero for every thread of the process that
    loads it (torch's numerics, hypothesis' subnormal floats)."""
    import subprocess
    import sys

    code = ("from paged_kernels import native; assert native.load('paged_decode_attention') is not None; "
            "print(5e-324 * 1.0 != 0.0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_sees_chunks_padded_to_few_shapes(paged_batch, monkeypatch, dtype):
    """SDPA's CPU kernel keeps a compiled GEMM per block shape: a chunk's rows go up to a multiple
    of 32 and its positions to one of 64 (zeros, never attended by a real row), and the result is
    still the reference's (chunks with and without cached context)."""
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: shapes.append((q.shape[2], k.shape[2], kw["is_causal"])) or sdpa(q, k, v, **kw))
    batch = paged_batch(q_lens=[37, 100, 1], seq_lens=[37, 130, 50], num_heads=6, num_kv_heads=2, head_dim=64,
                        block_size=16, head_major=True, dtype=dtype)
    qsl = batch.query_start_loc.tolist()
    for s, expected in ((0, (64, 64, True)), (1, (128, 192, False))):
        out = cpu._prefill(batch.query[qsl[s]:qsl[s + 1]], batch.key_cache, batch.value_cache, batch.block_tables[s],
                           int(batch.seq_lens[s]), batch.scale)
        assert shapes[-1] == expected
        want = ref_paged_attention(*batch.args())[qsl[s]:qsl[s + 1]]
        torch.testing.assert_close(out.float(), want.float(), **TOLERANCE[dtype])
