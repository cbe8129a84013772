"""The persistent batch follows step diffs: rows are reused, tables only grow, params are columns."""

from __future__ import annotations

import numpy as np
import pytest

from servicekit.contract.step import CachedRequestData
from worker.factories import new_req
from worker_service.input_batch import InputBatch


def make_batch(**overrides) -> InputBatch:
    values = dict(max_num_reqs=3, max_model_len=32, max_blocks_per_req=8, vocab_size=64, eos_token_ids=(2,))
    values.update(overrides)
    return InputBatch(**values)


def test_add_fills_a_row_with_tokens_blocks_and_params():
    batch = make_batch()
    row = batch.add(new_req("a", [5, 6, 7], [4, 2], outputs=[9], num_computed_tokens=2, temperature=0.5,
                            top_k=3, seed=11, logprobs=2))
    assert batch.token_ids[row, :4].tolist() == [5, 6, 7, 9]
    assert (batch.num_tokens[row], batch.num_prompt_tokens[row], batch.num_computed_tokens[row]) == (4, 3, 2)
    assert batch.block_table[row, :2].tolist() == [4, 2] and batch.num_blocks[row] == 2
    assert (batch.temperature[row], batch.top_k[row], batch.seed[row], batch.num_logprobs[row]) == (0.5, 3, 11, 2)


def test_prompt_logprobs_are_computed_only_before_the_first_output():
    batch = make_batch()
    fresh = batch.add(new_req("a", [5, 6, 7], [1], prompt_logprobs=3))
    resumed = batch.add(new_req("b", [5, 6, 7], [2], outputs=[9], prompt_logprobs=3))  # it published them
    plain = batch.add(new_req("c", [5, 6, 7], [3]))
    assert batch.num_prompt_logprobs[[fresh, resumed, plain]].tolist() == [3, -1, -1]


def test_update_appends_blocks_and_takes_computed_count():
    batch = make_batch()
    row = batch.add(new_req("a", [1] * 5, [3, 4]))
    batch.update(CachedRequestData(["a"], [[8]], [5]))
    assert batch.block_table[row, :3].tolist() == [3, 4, 8]
    assert batch.num_computed_tokens[row] == 5


def test_rows_are_reused_lowest_first():
    batch = make_batch()
    rows = [batch.add(new_req(r, [1], [1])) for r in "abc"]
    assert rows == [0, 1, 2]
    with pytest.raises(ValueError, match="full"):
        batch.add(new_req("d", [1], [1]))
    batch.remove("b")
    batch.remove("a")
    assert batch.add(new_req("d", [1], [1])) == 0
    assert set(batch.rows) == {"c", "d"} and len(batch) == 2


def test_append_tokens_is_vectorised():
    batch = make_batch()
    a, b = batch.add(new_req("a", [1, 2], [1])), batch.add(new_req("b", [3], [2]))
    batch.append_tokens(np.array([a, b]), np.array([7, 8], dtype=np.int32))
    assert batch.token_ids[a, :3].tolist() == [1, 2, 7] and batch.token_ids[b, :2].tolist() == [3, 8]
    assert batch.num_tokens[[a, b]].tolist() == [3, 2]


def test_too_long_and_unseeded_requests_are_refused():
    batch = make_batch(max_model_len=4)
    with pytest.raises(AssertionError):  # the length rule was checked where the request entered
        batch.add(new_req("a", [1] * 5, [1, 2]))
    with pytest.raises(ValueError, match="seed"):
        batch.add(new_req("b", [1], [1], seed=None))
    assert len(batch) == 0
