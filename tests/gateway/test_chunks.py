"""ChunkAssembler: a request's output records -> the chunks its reader gets, around the token that
ends the output as a stop token (vLLM's rule: in the token ids, not in the text, the id reported)."""

from __future__ import annotations

import pytest

from gateway_service.chunks import ChunkAssembler
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import EngineCoreOutput, FinishReason
from servicekit.proto.queue import engine_output_to_bytes

STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH


@pytest.fixture
def ids(hf_tokenizer):
    a, b, s = hf_tokenizer.encode("hello world again", add_special_tokens=False)[:3]
    return a, b, s, hf_tokenizer.eos_token_id


def assemble(tokenizer, records, stop_id, *, resume=None, skip_special=True, keep=False):
    """(text, token ids, stop_token_id, finish reason) of feeding ``records`` one feed each;
    a record is (token ids, first index, finish reason)."""
    asm = ChunkAssembler("r", tokenizer, [1], SamplingParams(max_tokens=10, stop_token_ids=[stop_id]),
                         resume_from_index=resume, skip_special_tokens=skip_special, include_stop_str=keep,
                         on_stop_string=lambda: None)
    text, tokens, last = "", [], None
    for token_ids, first, finish in records:
        chunk = asm.feed([engine_output_to_bytes(EngineCoreOutput("r", list(token_ids), first, finish))])
        if chunk is not None:
            text, tokens, last = text + chunk.text, tokens + chunk.token_ids, chunk
    assert asm.done or last.finish_reason is not None
    return text, tokens, last.stop_token_id, last.finish_reason


def test_a_stop_token_stays_in_the_ids_not_the_text_however_records_arrive(hf_tokenizer, ids):
    a, b, s, _eos = ids
    before = assemble(hf_tokenizer, [([a, b], 0, LENGTH)], s)[0]  # the text of a, b
    expected = (before, [a, b, s], s, STOP)
    assert assemble(hf_tokenizer, [([a, b, s], 0, STOP)], s) == expected  # --stream-interval: one record
    assert assemble(hf_tokenizer, [([a], 0, None), ([b], 1, None), ([s], 2, STOP)], s) == expected
    # replayed after a failover: the new scheduler publishes from index 0 again
    assert assemble(hf_tokenizer, [([a, b], 0, None), ([a, b, s], 0, STOP)], s) == expected
    # a reader resuming at the stop token gets it with no text
    assert assemble(hf_tokenizer, [([a, b, s], 0, STOP)], s, resume=2) == ("", [s], s, STOP)


def test_include_stop_str_keeps_its_text_and_eos_is_a_stop_token_without_an_id(hf_tokenizer, ids):
    a, b, s, eos = ids
    whole = assemble(hf_tokenizer, [([a, b, s], 0, LENGTH)], s)[0]  # the text of a, b, s
    assert assemble(hf_tokenizer, [([a, b, s], 0, STOP)], s, keep=True) == (whole, [a, b, s], s, STOP)
    before = assemble(hf_tokenizer, [([a, b], 0, LENGTH)], s, skip_special=False)[0]
    # EOS ends the output without its text even when special tokens are kept, and it is no stop id
    assert assemble(hf_tokenizer, [([a, b, eos], 0, STOP)], s, skip_special=False) == (before, [a, b, eos], None, STOP)
    # a stop token within the output (not ending it) is text like any other
    assert assemble(hf_tokenizer, [([s, a], 0, LENGTH)], s)[0] == assemble(hf_tokenizer, [([s, a], 0, LENGTH)], 0)[0]


def test_a_record_that_comes_before_the_one_it_follows_waits_for_it(hf_tokenizer, ids):
    """After a takeover the old owner's retried publish of a later index can reach the stream before
    the new owner writes the index before it again (the first copy lost in a Redis failover): the
    reader gets every index once, in order, never a gap."""
    a, b, s, _eos = ids
    in_order = assemble(hf_tokenizer, [([a], 0, None), ([b], 1, None), ([a], 2, None), ([b], 3, LENGTH)], s)
    assert in_order[1] == [a, b, a, b]
    # index 2 early (held back), then the new owner's catch-up from index 1, then the rest
    assert assemble(hf_tokenizer, [([a], 0, None), ([a], 2, None), ([b, a], 1, None), ([b], 3, LENGTH)], s) == in_order
    # the last record early: the stream does not end before the index it lacks came
    assert assemble(hf_tokenizer, [([a], 0, None), ([a, b], 2, LENGTH), ([b], 1, None)], s) == in_order
    asm = ChunkAssembler("r", hf_tokenizer, [1], SamplingParams(max_tokens=10), resume_from_index=None,
                         skip_special_tokens=True, on_stop_string=lambda: None)
    assert asm.feed([engine_output_to_bytes(EngineCoreOutput("r", [a], 0))]).token_ids == [a]
    assert asm.feed([engine_output_to_bytes(EngineCoreOutput("r", [b], 2, LENGTH))]) is None  # held: no chunk
    assert not asm.done
    chunk = asm.feed([engine_output_to_bytes(EngineCoreOutput("r", [b], 1))])
    assert (chunk.first_index, chunk.token_ids, chunk.finish_reason, asm.done) == (1, [b, b], LENGTH, True)


def test_a_gap_below_where_a_reader_resumes_holds_nothing(hf_tokenizer, ids):
    """Indices its client had: a record lost among them (no scheduler writes it again) does not stop
    the resumed reader."""
    a, b, s, _eos = ids
    assert assemble(hf_tokenizer, [([a], 0, None), ([b], 2, None), ([a, b], 3, LENGTH)], s, resume=2)[1] == [b, a, b]
