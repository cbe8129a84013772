"""Structured output in the worker: a row's grammar matcher rebuilt from the tokens a request
already delivered is in the state the uninterrupted one reached; a request preempted (its blocks
lost, its row rebuilt) continues with the tokens of a run without preemption; the sampler's
bitmask masks exactly the tokens it leaves out."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from servicekit.contract.structured_output import StructuredOutput
from servicekit.grammar import GrammarCompiler
from worker_service.sampler import mask_to_grammar
from worker_service.structured_output import StructuredRows

from helpers.stack import DTYPE

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "minItems": 2, "maxItems": 4,
             "items": {"type": "string", "pattern": "^[a-z]{2,6}$"}}}, "required": ["id", "tags"]}


@pytest.fixture(scope="module")
def compiler(hf_tokenizer):
    return GrammarCompiler(hf_tokenizer, len(hf_tokenizer), (hf_tokenizer.eos_token_id,))


def test_a_rebuilt_matcher_masks_as_the_one_that_saw_every_token(compiler, hf_tokenizer):
    constraint = StructuredOutput("json_schema", json.dumps(SCHEMA))
    text = '{"id": 42, "tags": ["ab", "cde"]}'
    tokens = hf_tokenizer.encode(text, add_special_tokens=False)
    live = StructuredRows(len(hf_tokenizer), (hf_tokenizer.eos_token_id,), lambda: compiler)
    live.add(0, constraint, [])
    for k, token in enumerate(tokens):
        rebuilt = StructuredRows(len(hf_tokenizer), (hf_tokenizer.eos_token_id,), lambda: compiler)
        rebuilt.add(3, constraint, tokens[:k])  # a request resumed after k delivered tokens
        (_, want), (_, got) = live.bitmask(np.array([0])), rebuilt.bitmask(np.array([3]))
        assert torch.equal(want, got), f"after {k} tokens"
        live.accept(np.array([0]), np.array([token]))
    # the whole object: only EOS may follow
    (_, mask) = live.bitmask(np.array([0]))
    allowed = [t for t in range(len(hf_tokenizer)) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed == [hf_tokenizer.eos_token_id]


def test_a_row_outside_its_grammar_may_only_end(compiler, hf_tokenizer):
    """Delivered tokens the grammar refuses (never made here; a corrupted record) end the request
    rather than crash the worker or sample outside the grammar."""
    rows = StructuredRows(len(hf_tokenizer), (hf_tokenizer.eos_token_id,), lambda: compiler)
    rows.add(0, StructuredOutput("regex", "[0-9]+"), hf_tokenizer.encode("abc", add_special_tokens=False))
    (_, mask) = rows.bitmask(np.array([0]))
    eos = hf_tokenizer.eos_token_id
    assert int(mask.count_nonzero()) == 1 and (int(mask[0, eos // 32]) >> (eos % 32)) & 1


def test_the_sampler_masks_the_tokens_a_bitmask_leaves_out():
    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    allowed = {0, 31, 32, 63, 69}
    words = torch.zeros((1, 3), dtype=torch.int32)
    for t in allowed:
        words[0, t // 32] |= (1 << (t % 32)) - (1 << 32 if t % 32 == 31 else 0)
    logits = torch.randn(3, vocab)
    out = mask_to_grammar(logits, (torch.tensor([1]), words))
    assert torch.equal(out[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched
    assert {t for t in range(vocab) if torch.isfinite(out[1, t])} == allowed


def test_preempted_constrained_requests_continue_as_if_never_preempted(tiny_model_dir, hf_model, llm):
    prompts = [f"Record {i}: the archive listed" for i in range(12)]
    params = SamplingParams(max_tokens=120, temperature=0.7, seed=5, structured_output={"json": SCHEMA})
    expected = llm.generate(prompts, params)
    tight = LLM(tiny_model_dir, hf_model=hf_model, num_blocks=24, max_num_seqs=12, dtype=DTYPE)
    got = tight.generate(prompts, params)

    assert tight.scheduler.num_preemptions > 0  # the pool is too small for all of them at once
    for want, out in zip(expected, got, strict=True):
        assert out.token_ids == want.token_ids
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
