"""Section 1: the KV-cache kernels on the device against ``paged_kernels.reference``.

For each dtype (fp32, fp16, bf16) and each attention shape (GQA groups of real models, two block
sizes): ``reshape_and_cache`` must equal the reference bit for bit, and ``paged_attention`` must
match it (relative L2 error under a per-dtype tolerance) on a decode-only batch — with the
heuristic's split, the single pass and forced split-K — and on a mixed batch of decodes and
prefill chunks (a first chunk without context, later chunks with earlier ones cached).
On CUDA the shapes are real (contexts to 8k, chunks of 512); dry, tiny (the interpreter is slow).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpucheck.common import Context, log, rel_l2

# Relative L2 error allowed against the fp32 reference math. 16-bit kernels round the
# probabilities to the input dtype before P @ V (as tensor cores need); fp32 runs IEEE dots.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


@dataclass(frozen=True)
class AttentionShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


@dataclass(frozen=True)
class Suite:
    shapes: tuple[AttentionShape, ...]
    decode_lens: tuple[int, ...]  # context of each decode row (one at position 0)
    mixed_q_lens: tuple[int, ...]  # new tokens per sequence of the mixed batch
    mixed_seq_lens: tuple[int, ...]  # context incl. the new tokens
    forced_splits: int
    cache_tokens: int  # tokens written by the reshape_and_cache check
    # fp16 / bf16 run the first this many shapes (each case compiles its own kernels: the budget)
    half_precision_shapes: int


REAL = Suite(
    shapes=(
        AttentionShape("llama3-8b gqa4 d128", 32, 8, 128, 16),
        AttentionShape("qwen2.5-0.5b gqa7 d64", 14, 2, 64, 16),
        AttentionShape("mha d64 bs32", 8, 8, 64, 32),
    ),
    decode_lens=(8192, 1, 17, 4096, 777, 3001, 64, 5000),
    mixed_q_lens=(1, 1, 1, 1, 1, 1, 512, 300, 37, 1),
    mixed_seq_lens=(2000, 1, 700, 4100, 33, 999, 512, 2348, 1037, 6000),
    forced_splits=8,
    cache_tokens=4096,
    half_precision_shapes=2,
)
DRY = Suite(
    shapes=(
        AttentionShape("gqa2 d16", 4, 2, 16, 4),
        AttentionShape("gqa3 d32 bs8", 3, 1, 32, 8),
    ),
    decode_lens=(40, 1, 17),
    mixed_q_lens=(1, 7, 1, 12),
    mixed_seq_lens=(30, 7, 3, 33),
    forced_splits=3,
    cache_tokens=24,
    half_precision_shapes=1,
)


def make_batch(q_lens, seq_lens, shape: AttentionShape, dtype, device: str, generator):
    """A paged batch over a random cache with shuffled, distinct blocks per sequence (+ spare
    blocks no sequence owns, so a read of the wrong block changes the result)."""
    import torch

    blocks_per_seq = [-(-n // shape.block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 16
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache, value_cache = (torch.randn(cache_shape, generator=generator).to(dtype).to(device) for _ in range(2))
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = order[start : start + n]
        start += n
    # a larger query scale makes softmax peaky: outputs O(1), so errors do not average away
    query = 4 * torch.randn(sum(q_lens), shape.num_heads, shape.head_dim, generator=generator)
    return dict(
        query=query.to(dtype).to(device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale=shape.head_dim**-0.5,
    )


def check_cache_write(shape: AttentionShape, dtype, suite: Suite, device: str, generator) -> dict:
    import torch

    from paged_kernels.cache import reshape_and_cache
    from paged_kernels.reference import ref_reshape_and_cache

    num_blocks = 2 * -(-suite.cache_tokens // shape.block_size)
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(dtype).to(device)
    value_cache = torch.randn(cache_shape, generator=generator).to(dtype).to(device)
    slots = torch.randperm(num_blocks * shape.block_size, generator=generator)[: suite.cache_tokens]
    slots[::7] = -1  # padding tokens are not stored
    rows = (suite.cache_tokens, shape.num_kv_heads, shape.head_dim)
    key = torch.randn(rows, generator=generator).to(dtype).to(device)
    value = torch.randn(rows, generator=generator).to(dtype).to(device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    ref_reshape_and_cache(key, value, expected_k, expected_v, slots.to(device))
    reshape_and_cache(key, value, key_cache, value_cache, slots.to(device))
    exact = torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    return dict(kernel="reshape_and_cache", tokens=suite.cache_tokens, passed=bool(exact))


def check_attention(batch: dict, expected, tolerance: float, **kwargs) -> dict:
    import torch

    from paged_kernels.paged_attention import paged_attention

    out = paged_attention(**batch, **kwargs)
    error = rel_l2(out, expected)
    finite = bool(torch.isfinite(out.float()).all())
    return dict(kernel="paged_attention", rel_l2_err=error, passed=finite and error <= tolerance)


def run(ctx: Context) -> dict:
    import torch

    from paged_kernels.reference import ref_paged_attention

    suite = DRY if ctx.dry else REAL
    checks: list[dict] = []
    for dtype_name in ("float32", "float16", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        shapes = suite.shapes if dtype_name == "float32" else suite.shapes[: suite.half_precision_shapes]
        for shape in shapes:
            if ctx.seconds_left() < 0:
                return dict(passed=False, checks=checks, error="out of time before every case ran")
            generator = torch.Generator().manual_seed(len(checks))
            where = dict(dtype=dtype_name, shape=shape.name)
            checks.append({**where, "batch": "cache write", **check_cache_write(shape, dtype, suite, ctx.device, generator)})
            decode = make_batch([1] * len(suite.decode_lens), suite.decode_lens, shape, dtype, ctx.device, generator)
            expected = ref_paged_attention(**decode)
            tol = TOLERANCE[dtype_name]
            for label, kwargs in (("heuristic", {}), ("single pass", dict(num_splits=1)),
                                  (f"split-K {suite.forced_splits}", dict(num_splits=suite.forced_splits, max_query_len=1))):
                checks.append({**where, "batch": f"decode, {label}", **check_attention(decode, expected, tol, **kwargs)})
            mixed = make_batch(suite.mixed_q_lens, suite.mixed_seq_lens, shape, dtype, ctx.device, generator)
            expected = ref_paged_attention(**mixed)
            for label, kwargs in (("max_query_len unknown", {}), ("max_query_len given", dict(max_query_len=max(suite.mixed_q_lens))),
                                  (f"split-K {suite.forced_splits}", dict(num_splits=suite.forced_splits))):
                checks.append({**where, "batch": f"mixed, {label}", **check_attention(mixed, expected, tol, **kwargs)})
            failed = [c for c in checks[-7:] if not c["passed"]]
            log(f"kernels {dtype_name} {shape.name}: {7 - len(failed)}/7 ok" + (f"; FAILED {failed}" if failed else ""))
            ctx.save_partial(dict(passed=False, checks=checks, error="stopped before every case ran"))
            del decode, mixed, expected
    passed = sum(c["passed"] for c in checks)
    log(f"kernel suite: {passed}/{len(checks)} checks passed")
    return dict(passed=passed == len(checks), num_checks=len(checks), num_passed=passed, checks=checks)
