"""The C decode kernel of the CPU backend against the torch reference, and its build/fallback."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu, native
from kernels.reference import ref_paged_attention

pytestmark = pytest.mark.kernel

needs_native = pytest.mark.skipif(not cpu.available(), reason="no C compiler on this machine")

MIXED = dict(q_lens=[1, 7, 1, 20, 1], seq_lens=[150, 7, 37, 90, 1])
DECODE = dict(q_lens=[1] * 6, seq_lens=[150, 37, 1, 64, 16, 17])


@needs_native
@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # two specialised sizes and the generic loop
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_major", [False, True], ids=["block-major", "head-major"])
def test_cpu_attention_matches_reference(paged_batch, shape, gqa, head_dim, block_size, head_major):
    batch = paged_batch(**shape, num_heads=2 * gqa, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                        head_major=head_major)

    out = cpu.cpu_paged_attention(*batch.args())

    torch.testing.assert_close(out, ref_paged_attention(*batch.args()), atol=2e-6, rtol=1e-5)


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
def test_cpu_attention_uses_the_kernel_for_decode_rows(paged_batch, monkeypatch):
    import kernels.cpu as module

    def no_reference(*args, **kwargs):
        raise AssertionError("fp32 decode rows must not take the reference path")

    monkeypatch.setattr(module, "_decode", no_reference)
    batch = paged_batch(**DECODE, num_heads=6, num_kv_heads=2, head_dim=64)
    module.cpu_paged_attention(*batch.args())


def test_cpu_attention_falls_back_to_reference_for_bf16(paged_batch):
    batch = paged_batch(**DECODE, num_heads=4, num_kv_heads=2, dtype=torch.bfloat16)

    out = cpu.cpu_paged_attention(*batch.args())

    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_paged_attention(*batch.args()))


def test_without_a_compiler_cpu_backend_is_the_reference(paged_batch, monkeypatch, tmp_path, caplog):
    from kernels import get_attention_ops

    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-xyz")

    assert not cpu.available()
    assert "no C compiler" in caplog.text
    assert get_attention_ops("cpu").backend == "torch"
    assert get_attention_ops("auto").backend == ("triton" if torch.cuda.is_available() else "torch")
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
