"""Triton ``paged_attention`` against its reference (interpreter on the CPU).

fp32 runs the full product of GQA ratio x head_dim x block_size x batch shape x (single pass,
split-K); the 16-bit dtypes run a slice of it, and two cases let the heuristic choose the split.
"""

from __future__ import annotations

import pytest
import torch

from paged_kernels.cache import reshape_and_cache
from paged_kernels.paged_attention import _choose_config, _launch, _LaunchConfig, paged_attention
from paged_kernels.reference import ref_paged_attention, ref_reshape_and_cache

pytestmark = pytest.mark.kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Decode rows (one at position 0), a first prefill chunk (no context), a later chunk whose context
# holds the earlier chunks; most lengths end mid-block for both block sizes.
MIXED = dict(q_lens=[1, 7, 1, 20, 1], seq_lens=[150, 7, 37, 90, 1])
DECODE = dict(q_lens=[1, 1, 1, 1], seq_lens=[150, 37, 1, 64])
BATCHES = {"mixed": MIXED, "decode": DECODE}

# Tolerances per dtype: the kernel rounds the probabilities to the input dtype before P @ V (as a
# tensor core needs), the reference keeps them in fp32, and both round the output.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

FP32_CASES = [
    (gqa, head_dim, block_size, batch, num_splits, torch.float32)
    for gqa in (1, 3)
    for head_dim in (16, 64)
    for block_size in (4, 16)
    for batch in BATCHES
    for num_splits in (1, 3)
]
HALF_CASES = [
    (gqa, head_dim, block_size, batch, num_splits, dtype)
    for dtype in (torch.float16, torch.bfloat16)
    for gqa, head_dim, block_size in ((3, 64, 16), (1, 16, 4))
    for batch in BATCHES
    for num_splits in (1, 4)
]
HEURISTIC_CASES = [
    (1, 64, 16, "decode", None, torch.float32),
    (3, 64, 16, "mixed", None, torch.bfloat16),
]
CASES = FP32_CASES + HALF_CASES + HEURISTIC_CASES


def case_id(case) -> str:
    gqa, head_dim, block_size, batch, splits, dtype = case
    dtype_name = str(dtype).removeprefix("torch.")
    return f"gqa{gqa}-d{head_dim}-bs{block_size}-{batch}-splits{splits}-{dtype_name}"


TENSOR_FIELDS = ("query", "key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens")


def to_device(batch):
    for name in TENSOR_FIELDS:
        setattr(batch, name, getattr(batch, name).to(DEVICE))
    return batch


def assert_matches_reference(out, batch):
    expected = ref_paged_attention(*batch.args())
    tol = TOLERANCE[batch.query.dtype]
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_paged_attention_matches_reference(paged_batch, case):
    gqa, head_dim, block_size, batch_name, num_splits, dtype = case
    batch = to_device(
        paged_batch(
            **BATCHES[batch_name],
            num_heads=2 * gqa,
            num_kv_heads=2,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
        )
    )

    out = paged_attention(*batch.args(), num_splits=num_splits)

    assert_matches_reference(out, batch)


def choose(num_tokens, num_seqs, **overrides):
    settings = dict(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_kv_heads=8,
        queries_per_kv=4,
        head_dim=128,
        max_query_len=None,
        num_splits=None,
        device=torch.device("cpu"),  # counts as 4 SMs
    )
    return _choose_config(**(settings | overrides))


def test_launcher_splits_only_decode_batches_too_small_to_fill_the_gpu():
    assert choose(1, 1, num_kv_heads=1).num_splits == 16  # 1 program for 4 "SMs": the cap
    assert choose(1, 1, num_kv_heads=2).num_splits == 8  # 2 programs -> 16 with the splits
    assert choose(4, 4).num_splits == 1  # 32 programs: enough
    assert choose(40, 4).num_splits == 1  # prefill chunks: never by default
    assert choose(40, 4, num_splits=3).num_splits == 3  # an explicit value wins
    assert choose(1, 1, num_splits=1).num_splits == 1


def test_launcher_block_shape_follows_the_batch():
    decode = choose(4, 4)
    assert decode.one_token_per_seq and decode.block_q == 1 and decode.block_m == 16
    assert not choose(4, 4, max_query_len=7).one_token_per_seq  # the caller's word wins
    assert choose(4, 3, max_query_len=1).one_token_per_seq  # e.g. a sequence with no new token
    long_chunks = choose(300, 4, max_query_len=256)
    assert (long_chunks.block_m, long_chunks.block_q) == (64, 16)


def test_paged_attention_heuristic_splits_a_few_long_decodes(paged_batch):
    batch = to_device(paged_batch(q_lens=[1, 1], seq_lens=[150, 37], num_heads=4, num_kv_heads=2))
    heuristic = _choose_config(
        num_tokens=2,
        num_seqs=2,
        num_kv_heads=2,
        queries_per_kv=2,
        head_dim=16,
        max_query_len=None,
        num_splits=None,
        device=batch.query.device,
    )
    assert heuristic.num_splits > 1 or DEVICE == "cuda"

    out = paged_attention(*batch.args())

    assert_matches_reference(out, batch)


def test_paged_attention_long_chunk_block_shape_writes_into_out(paged_batch):
    """``max_query_len`` >= 128 picks 64-row programs (BLOCK_Q > 1 with GQA); ``out`` is filled."""
    batch = to_device(paged_batch(**MIXED, num_heads=4, num_kv_heads=1, block_size=16))
    out = torch.full_like(batch.query, float("nan"))

    returned = paged_attention(*batch.args(), out=out, max_query_len=128)

    assert returned is out
    assert_matches_reference(out, batch)


def test_paged_attention_decode_batch_through_the_general_grid(paged_batch):
    """A ``max_query_len`` above 1 sends decodes through the searched, multi-token grid."""
    batch = to_device(paged_batch(**DECODE, num_heads=6, num_kv_heads=2))

    out = paged_attention(*batch.args(), max_query_len=4, num_splits=2)

    assert_matches_reference(out, batch)


def test_paged_attention_tile_smaller_than_cache_block(paged_batch):
    """A K/V tile may cover part of a cache block: 16-position tiles over 32-token blocks."""
    batch = to_device(paged_batch(**MIXED, num_heads=3, num_kv_heads=1, block_size=32))
    config = _LaunchConfig(block_m=16, block_q=5, tile_size=16, num_splits=3)

    out = _launch(*batch.args(), None, config)

    assert_matches_reference(out, batch)


def test_paged_attention_non_power_of_two_head_dim(paged_batch):
    batch = to_device(paged_batch(**DECODE, num_heads=4, num_kv_heads=2, head_dim=24))

    out = paged_attention(*batch.args(), num_splits=2)

    assert_matches_reference(out, batch)


def test_step_written_by_reshape_and_cache_then_attended(paged_batch):
    """One model step: write the new tokens' K/V into the cache, then attend — Triton end to end
    against the reference end to end."""
    batch = to_device(paged_batch(**MIXED, num_heads=6, num_kv_heads=2, block_size=16))
    block_size = batch.key_cache.shape[1]
    qsl, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    slots = []
    for s, seq_len in enumerate(lens):
        for pos in range(seq_len - (qsl[s + 1] - qsl[s]), seq_len):
            block = int(batch.block_tables[s, pos // block_size])
            slots.append(block * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, device=DEVICE)
    new_key = torch.randn(len(slots), 2, 16, device=DEVICE)
    new_value = torch.randn(len(slots), 2, 16, device=DEVICE)
    ref_k, ref_v = batch.key_cache.clone(), batch.value_cache.clone()
    ref_reshape_and_cache(new_key, new_value, ref_k, ref_v, slot_mapping)
    expected = ref_paged_attention(batch.query, ref_k, ref_v, *batch.args()[3:])

    reshape_and_cache(new_key, new_value, batch.key_cache, batch.value_cache, slot_mapping)
    out = paged_attention(*batch.args())

    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def _replace(batch, **fields):
    args = dict(
        query=batch.query,
        key_cache=batch.key_cache,
        value_cache=batch.value_cache,
        block_tables=batch.block_tables,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        scale=batch.scale,
    )
    args.update(fields)
    return args


BAD_INPUTS = [
    (lambda b: dict(query=b.query[0]), "query must be a 3-d tensor"),
    (lambda b: dict(query=b.query[:, :1]), "multiple of the cache's num_kv_heads"),
    (lambda b: dict(query=b.query[..., :8]), "head_dim 16 != query head_dim 8"),
    (lambda b: dict(key_cache=b.key_cache.half()), "must match key_cache"),
    (
        lambda b: dict(key_cache=b.key_cache.half(), value_cache=b.value_cache.half()),
        "key_cache dtype torch.float16 != query dtype torch.float32",
    ),
    (lambda b: dict(query=b.query.to(torch.int32)), "query must have dtype"),
    (lambda b: dict(block_tables=b.block_tables.long()), "block_tables must have dtype"),
    (lambda b: dict(seq_lens=b.seq_lens.long()), "seq_lens must have dtype"),
    (lambda b: dict(query_start_loc=b.query_start_loc[:-1]), "needs num_seqs \\+ 1"),
    (lambda b: dict(block_tables=b.block_tables[:2]), "block_tables has 2 rows for 5 sequences"),
    (lambda b: dict(block_tables=b.block_tables.t().contiguous().t()), "last dimension"),
    (lambda b: dict(out=torch.empty_like(b.query[:-1])), "out must be"),
    (lambda b: dict(num_splits=0), "num_splits must be None or an int >= 1"),
    (lambda b: dict(max_query_len=0), "max_query_len must be None or an int >= 1"),
]


@pytest.mark.parametrize("corrupt, message", BAD_INPUTS)
def test_paged_attention_rejects_bad_inputs(paged_batch, corrupt, message):
    batch = to_device(paged_batch(**MIXED))

    with pytest.raises(ValueError, match=message):
        paged_attention(**_replace(batch, **corrupt(batch)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter message")
def test_paged_attention_explains_cpu_tensors_without_interpreter(paged_batch, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch = paged_batch(**DECODE)

    with pytest.raises(ValueError, match="use paged_kernels.reference on the CPU"):
        paged_attention(*batch.args())
