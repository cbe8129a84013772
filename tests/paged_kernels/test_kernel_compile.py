"""The kernels compile for a real GPU (Hopper, sm_90) even where there is none.

The interpreter is more lenient than the compiler (types of loop-carried values, constexpr rules,
layouts), so a kernel that passes every interpreted test could still fail to build on the GPU
machine. Triton can compile ahead of time for a given target without a device; this file does that
in a subprocess (the test process has ``TRITON_INTERPRET=1``, which makes kernels interpreted) for
the configurations the launchers pick, with the 16-byte divisibility hints the JIT would derive, so
the software pipeliner and tensor-core paths are the ones the GPU will run.

Run directly (``python tests/kernels/test_kernel_compile.py``) it prints one line per kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.kernel


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real kernels instead")
def test_kernels_compile_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=240
    )
    if "NO_NVIDIA_BACKEND" in result.stdout:
        pytest.skip("this Triton build has no NVIDIA backend")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("cubin ok") == len(_configs()), result.stdout


def _configs() -> list[tuple[str, dict]]:
    """(kernel name, constexprs) pairs: the launchers' realistic choices for a bf16 Llama-style
    model (head_dim 128, 32 query / 8 KV heads, block size 16), plus fp32 and odd shapes."""
    attention = dict(
        HEAD_DIM=128,
        HEAD_DIM_PADDED=128,
        BLOCK_SIZE=16,
        QUERIES_PER_KV=4,
        DOT_PRECISION="tf32",
        DOT_UPCAST=False,
    )
    decode = dict(attention, BLOCK_Q=1, BLOCK_M=16, TILE_SIZE=64, ONE_TOKEN_PER_SEQ=True)
    mixed = dict(attention, ONE_TOKEN_PER_SEQ=False)
    return [
        ("attention", dict(decode, NUM_SPLITS=1)),
        ("attention", dict(decode, NUM_SPLITS=4)),
        ("attention", dict(mixed, BLOCK_Q=16, BLOCK_M=64, TILE_SIZE=32, NUM_SPLITS=1)),
        ("attention", dict(mixed, BLOCK_Q=4, BLOCK_M=16, TILE_SIZE=64, NUM_SPLITS=2)),
        (
            "attention_fp32",
            dict(decode, HEAD_DIM=80, QUERIES_PER_KV=3, NUM_SPLITS=1, DOT_PRECISION="ieee"),
        ),
        ("merge", dict(HEAD_DIM=128, HEAD_DIM_PADDED=128, NUM_SPLITS=4, SPLITS_PADDED=4)),
        (
            "cache",
            dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PADDED=8, HEAD_DIM_PADDED=128, BLOCK_SIZE=16),
        ),
    ]


def main() -> None:
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        print("NO_NVIDIA_BACKEND")
        return
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        print("NO_NVIDIA_BACKEND")
        return

    from paged_kernels.cache import _reshape_and_cache_kernel
    from paged_kernels.paged_attention import _merge_splits_kernel, _paged_attention_kernel

    kernels = {
        "attention": (_paged_attention_kernel, "bf16"),
        "attention_fp32": (_paged_attention_kernel, "fp32"),
        "merge": (_merge_splits_kernel, "bf16"),
        "cache": (_reshape_and_cache_kernel, "bf16"),
    }
    int_pointers = {"block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr", "slot_mapping_ptr"}
    fp32_pointers = {"part_out_ptr", "part_max_ptr", "part_sum_ptr"}
    for name, constexprs in _configs():
        fn, dtype = kernels[name]
        signature, attrs = {}, {}
        for index, arg in enumerate(fn.arg_names):
            if arg in constexprs:
                signature[arg] = "constexpr"
                continue
            if arg in int_pointers:
                signature[arg] = "*i32"
            elif arg in fp32_pointers:
                signature[arg] = "*fp32"
            elif arg.endswith("_ptr"):
                signature[arg] = f"*{dtype}"
            else:
                signature[arg] = "fp32" if arg == "qk_scale" else "i32"
            if arg.endswith("_ptr") or arg.startswith("stride"):  # what the JIT sees in practice
                attrs[(index,)] = [["tt.divisibility", 16]]
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}
        )
        assert compiled.asm.get("cubin"), name
        splits = constexprs.get("NUM_SPLITS", "")
        print(f"{name} {splits} cubin ok, shared={compiled.metadata.shared}")


if __name__ == "__main__":
    main()
