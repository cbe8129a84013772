"""A call's reading of its request (gateway_service/generation.py's _Reading): records that came
before the ones they follow wait for them, and not forever."""

from __future__ import annotations

import asyncio
import logging

from gateway_service import generation
from gateway_service.chunks import ChunkAssembler
from gateway_service.output_fanout import Subscription
from servicekit.auth import TokenRateLimits
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import EngineCoreOutput, FinishReason
from servicekit.proto.queue import engine_output_to_bytes


def record(tokens: list[int], first: int, finish: FinishReason | None = None) -> bytes:
    return engine_output_to_bytes(EngineCoreOutput("r", tokens, first, finish))


def reading(hf_tokenizer) -> generation._Reading:
    assembler = ChunkAssembler("r", hf_tokenizer, [1], SamplingParams(max_tokens=8), resume_from_index=None,
                               skip_special_tokens=True, on_stop_string=lambda: None)
    return generation._Reading("r", Subscription("out:r"), assembler, "", TokenRateLimits(0), None)


async def test_a_gap_the_new_scheduler_fills_is_waited_for(hf_tokenizer):
    r = reading(hf_tokenizer)
    assert r.take([record([5], 0), record([7], 2)]).token_ids == [5]  # index 2 waits for 1
    assert r.gap_timer is not None
    chunk = r.take([record([6, 7], 1)])  # the catch-up: 1 and 2 again
    assert (chunk.first_index, chunk.token_ids) == (1, [6, 7])
    assert r.gap_timer is None
    assert r.take([record([8], 3, FinishReason.LENGTH)]).finish_reason is FinishReason.LENGTH


async def test_a_gap_nobody_fills_is_given_up_after_a_while(hf_tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(generation, "GAP_WAIT_S", 0.05)
    r = reading(hf_tokenizer)
    assert r.take([record([5], 0), record([7, 8], 2, FinishReason.LENGTH)]).token_ids == [5]
    assert not r.assembler.done
    with caplog.at_level(logging.WARNING):
        records = await asyncio.wait_for(r.sub.get(), 5)  # the timer's wake-up: an empty delivery
        chunk = r.take(records)
    assert (chunk.token_ids, chunk.finish_reason, r.assembler.done) == ([7, 8], FinishReason.LENGTH, True)
    assert "output indices 1..1 never came" in caplog.text
    assert r.gap_timer is None


async def test_a_reading_that_ends_while_records_wait_leaves_no_timer(hf_tokenizer, monkeypatch):
    monkeypatch.setattr(generation, "GAP_WAIT_S", 0.05)
    r = reading(hf_tokenizer)
    r.take([record([5], 0), record([7], 2)])
    r.close()
    await asyncio.sleep(0.1)
    assert r.sub.queue.empty() and r.gap_timer is None
