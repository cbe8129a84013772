"""``--stream-interval``: a request's tokens published every N, its first and last at once, nothing
lost or repeated (the batcher alone, then the engine loop against a scripted worker)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from servicekit.contract.scheduling import SchedulingConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine import WorkerEngine
from scheduler_service.config import SchedulerConfig
from scheduler_service.stream_interval import StreamBatcher
from servicekit.contract.step import EngineCoreOutput, FinishReason, TokenLogprobs
from servicekit.proto.pb import queue_pb2
from .test_engine_loop import INFO, ScriptedWorker, make_request


def out(rid, tokens, first, finish=None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput(rid, list(tokens), first, finish_reason=finish, **kw)


def test_interval_one_publishes_every_output_as_it_comes():
    batcher = StreamBatcher(1)
    step = [out("a", [5], 0), out("b", [6], 3)]
    assert batcher.take(step) == step
    assert batcher.num_held_tokens == 0


def test_first_tokens_at_once_then_every_interval_and_the_finish_with_what_was_held():
    batcher = StreamBatcher(3)
    assert batcher.take([out("a", [10], 0, num_cached_tokens=4)]) == [out("a", [10], 0, num_cached_tokens=4)]
    assert batcher.take([out("a", [11], 1)]) == []
    assert batcher.take([out("a", [12], 2)]) == []
    assert batcher.num_held_tokens == 2
    assert batcher.take([out("a", [13], 3)]) == [out("a", [11, 12, 13], 1)]
    assert batcher.take([out("a", [14], 4)]) == []
    assert batcher.take([out("a", [15], 5, FinishReason.LENGTH)]) == [out("a", [14, 15], 4, FinishReason.LENGTH)]
    assert batcher.num_held_tokens == 0
    # the request is forgotten: the same id again (a resume elsewhere, then back) starts afresh
    assert batcher.take([out("a", [16], 6)]) == [out("a", [16], 6)]


def test_logprobs_and_cached_counts_merge_with_their_tokens():
    batcher = StreamBatcher(2)
    lp = [TokenLogprobs(token_id=t, logprob=-0.5 * t, top=()) for t in range(4)]
    batcher.take([out("a", [0], 0, new_logprobs=lp[:1])])
    assert batcher.take([out("a", [1], 1, new_logprobs=lp[1:2], num_cached_tokens=8)]) == []
    merged = batcher.take([out("a", [2], 2, new_logprobs=lp[2:3])])
    assert merged == [out("a", [1, 2], 1, new_logprobs=lp[1:3], num_cached_tokens=8)]


def test_flush_forget_and_bad_interval():
    batcher = StreamBatcher(4)
    batcher.take([out("a", [1], 0), out("b", [2], 0)])
    batcher.take([out("a", [3], 1), out("b", [4], 1)])
    assert batcher.flush(["a"]) == [out("a", [3], 1)]
    batcher.forget(["b"])
    assert batcher.num_held_tokens == 0 and batcher.flush() == []
    with pytest.raises(ValueError, match="stream interval"):
        StreamBatcher(0)
    with pytest.raises(ValueError, match="stream_interval"):
        SchedulerConfig(stream_interval=0)


@pytest.mark.parametrize("interval", [1, 2, 3, 7])
def test_random_steps_deliver_every_token_once_in_order(interval):
    """Requests of random lengths, 1 or 2 tokens a step (a prefill's first sample, speculative-like
    bursts), some aborted with tokens held: what is published joins to exactly what was produced,
    and nothing stays held longer than interval - 1 tokens."""
    rng = random.Random(interval)
    batcher = StreamBatcher(interval)
    produced: dict[str, list[int]] = {}
    published: dict[str, list[tuple[int, list[int], FinishReason | None]]] = {}
    live = {f"r{i}": rng.randint(1, 30) for i in range(12)}
    while live:
        step = []
        for rid, left in list(live.items()):
            if rng.random() < 0.2:
                continue  # not scheduled this step (a prefill chunk elsewhere, preempted)
            have = produced.setdefault(rid, [])
            n = min(left, rng.choice((1, 1, 1, 2)))
            tokens = [rng.randrange(1000) for _ in range(n)]
            finish = FinishReason.LENGTH if n == left else (FinishReason.ABORT if rng.random() < 0.03 else None)
            step.append(out(rid, tokens, len(have), finish))
            have.extend(tokens)
            if finish is None:
                live[rid] = left - n
            else:
                del live[rid]
        for o in batcher.take(step):
            published.setdefault(o.request_id, []).append((o.first_index, o.new_token_ids, o.finish_reason))
        assert all(len(o.new_token_ids) < interval for o in batcher._held.values())
    assert batcher.num_held_tokens == 0
    for rid, tokens in produced.items():
        records = published[rid]
        assert [i for i, _, _ in records] == [sum(len(t) for _, t, _ in records[:k]) for k in range(len(records))]
        assert [t for _, ts, _ in records for t in ts] == tokens
        assert records[-1][2] is not None and all(f is None for _, _, f in records[:-1])
        assert len(records[0][1]) <= 2  # the first tokens were not held


class RecordingQueue:
    def __init__(self) -> None:
        self.records: list[tuple[str, queue_pb2.EngineOutput]] = []
        self.finished: list[str] = []

    def route(self, records):
        return records

    async def publish_routed(self, records, finished_entry_ids) -> None:
        self.records.extend((rid, queue_pb2.EngineOutput.FromString(data)) for rid, data in records)
        self.finished.extend(finished_entry_ids)

    def of(self, rid: str) -> list[queue_pb2.EngineOutput]:
        return [r for request_id, r in self.records if request_id == rid]


class LosableWorker(ScriptedWorker):
    """Steps until told to fail the stream (as a dead worker's broken call)."""

    def __init__(self, fail_after_steps: int) -> None:
        super().__init__()
        self.steps_left = fail_after_steps
        self.broken = asyncio.Event()

    async def step(self, so):
        from scheduler_service.worker_client import WorkerLostError

        if self.steps_left == 0:
            raise WorkerLostError("scripted:1 went away")
        self.steps_left -= 1
        return await super().step(so)

    def break_stream(self, reason: str = "") -> None:
        self.broken.set()


def make_engine(queue, worker, interval: int, on_lost=None) -> WorkerEngine:
    core = Scheduler(SchedulingConfig(max_num_seqs=8, max_num_batched_tokens=64), INFO)
    return WorkerEngine(worker, replace(INFO, worker_id="w", max_num_seqs=8, max_num_batched_tokens=64), core, queue,
                        max_queued=8, on_finished=lambda n, a: None, on_lost=on_lost, stream_interval=interval)


@pytest.mark.asyncio
async def test_engine_publishes_every_interval_tokens_first_and_last_at_once():
    queue = RecordingQueue()
    engine = make_engine(queue, ScriptedWorker(), 4)
    task = asyncio.create_task(engine.run())
    engine.submit(make_request("a", max_tokens=10), "entry-a")
    engine.submit(make_request("b", max_tokens=2), "entry-b")
    await asyncio.wait_for(engine.wait_idle(), 5)
    task.cancel()
    a = queue.of("a")
    assert [(r.first_index, len(r.token_ids)) for r in a] == [(0, 1), (1, 4), (5, 4), (9, 1)]
    assert [r.finish_reason for r in a][:-1] == [0, 0, 0] and a[-1].finish_reason != 0
    assert [(r.first_index, len(r.token_ids)) for r in queue.of("b")] == [(0, 1), (1, 1)]
    assert queue.finished == ["entry-b", "entry-a"]


@pytest.mark.asyncio
async def test_tokens_held_back_are_published_before_a_lost_workers_requests_are_handed_back():
    queue = RecordingQueue()
    handed = []
    engine = make_engine(queue, LosableWorker(fail_after_steps=3), 8,
                         on_lost=lambda engine, requests: handed.extend(requests))
    task = asyncio.create_task(engine.run())
    engine.submit(make_request("a", max_tokens=50), "entry-a")
    await asyncio.wait_for(task, 5)
    (request, entry_id), = handed
    published = [t for r in queue.of("a") for t in r.token_ids]
    # three steps sampled three tokens: the first went out at once, two were held, and all three
    # are published before the request resumes elsewhere from exactly those outputs
    assert entry_id == "entry-a" and list(request.output_token_ids) == published == [7, 7, 7]
    assert [r.first_index for r in queue.of("a")] == [0, 1]


@pytest.mark.asyncio
async def test_a_failing_requests_held_tokens_precede_its_error_record():
    queue = RecordingQueue()
    engine = make_engine(queue, ScriptedWorker(), 8)
    engine._batcher.take([out("a", [7], 0)])
    engine._batcher.take([out("a", [7], 1)])
    engine._entry_ids["a"] = "entry-a"
    await engine._publish([], [("a", "", "scheduler engine failed")])
    await engine._publishing
    records = queue.of("a")
    assert [(r.first_index, list(r.token_ids)) for r in records[:1]] == [(1, [7])]
    assert records[1].error_message == "scheduler engine failed"
    assert queue.finished == ["entry-a"]



@pytest.mark.service
@pytest.mark.asyncio(loop_scope="session")
async def test_a_stack_with_stream_interval_streams_the_same_tokens_in_fewer_chunks(
        tiny_model_dir, hf_model, hf_tokenizer, redis_server, llm):
    from pagedserve.aio_client import AsyncClient
    from servicekit.contract.sampling_params import SamplingParams
    from helpers.stack import in_process_stack

    prompts = ["The quick brown fox jumps over the lazy dog", "Once upon a time", "1, 2, 3,"]
    expected = llm.generate(prompts, SamplingParams(max_tokens=21, temperature=0, ignore_eos=True))
    # a stack of its own beside the session's, on other keys
    async with (in_process_stack(tiny_model_dir, hf_model, hf_tokenizer, redis_server.url, key_prefix="si:",
                                 stream_interval=4) as stack,
                AsyncClient(stack.gateway_address, timeout=60) as client):
        async def chunks(prompt):
            async with client.stream(prompt, max_tokens=21, temperature=0, ignore_eos=True) as stream:
                return [chunk async for chunk in stream]
        results = await asyncio.gather(*(chunks(p) for p in prompts))
    for got, want in zip(results, expected):
        assert [t for c in got for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in got) == want.text
        # records of 1 (the first token, never held) + 5 x 4: a chunk carries one record or more
        assert len(got) <= 6
        assert got[-1].finish_reason == "length" and got[-1].usage.completion_tokens == 21
