"""kill -9 workers in clusters of several shapes while greedy streams are mid-generation: as long
as one live worker can serve the model, every admitted stream completes — each output index once,
the tokens of a run without faults — whichever scheduler held it. A scheduler left without a
worker hands its requests back to the consumer group when another scheduler drives one (which
claims them at its next pending pass), or keeps them until a worker joins when none does.

Each test starts its own cluster (1 gateway, the schedulers and workers of its topology).
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from pagedserve.local_cluster import LocalCluster
from servicekit.contract.sampling_params import SamplingParams

from .conftest import start_worker, wait_for_async
from .streams import (
    assert_exactly_the_fault_free_outputs,
    assert_surviving_pools_all_free,
    busiest_worker,
    driven_workers,
    held_requests,
    streams_with_a_fault,
)

pytestmark = [pytest.mark.chaos, pytest.mark.service, pytest.mark.slow, pytest.mark.asyncio]

NUM_STREAMS = 12
MAX_TOKENS = 64
PROMPTS = [f"Request {i}: the river carried the boats past the mill" for i in range(NUM_STREAMS)]
FINISH_WITHIN_S = 60  # far beyond the bounded wait (docs/operations.md fault table); today's stranded ones never finish
REJOIN_AFTER_S = 5.0


@pytest.fixture(scope="module")
def expected(llm) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outputs]


async def settle(stack: LocalCluster, shares: list[int]) -> dict[str, list[str]]:
    """Wait until the schedulers drive ``shares`` workers (in any order); scheduler -> workers."""
    driven: dict[str, list[str]] = {}

    async def settled() -> bool:
        nonlocal driven
        driven = await driven_workers(stack)
        return sorted(len(w) for w in driven.values()) == sorted(shares)

    await wait_for_async(settled, 60, f"the schedulers drive {shares} workers", 0.2)
    return driven


def worker_at(stack: LocalCluster, address: str):
    return next(w for w in stack.live("worker") if w.address == address)


async def run_and_check(stack: LocalCluster, expected, fault) -> None:
    gateways = [g.address for g in stack.live("gateway")]
    logs = await streams_with_a_fault(gateways, PROMPTS, MAX_TOKENS, fault, finish_within_s=FINISH_WITHIN_S)
    assert_exactly_the_fault_free_outputs(logs, expected, MAX_TOKENS)


async def test_2_workers_2_schedulers_kill_one_worker(new_cluster, expected):
    """One worker each: the scheduler whose worker dies has none left (fewer workers than
    schedulers), so its requests go back to the group and finish on the other's worker."""
    stack = new_cluster(num_workers=2, num_schedulers=2)
    await settle(stack, [1, 1])

    async def kill_busiest_worker() -> None:
        victim = await busiest_worker(stack)
        stack.kill(victim)

    await run_and_check(stack, expected, kill_busiest_worker)
    await assert_surviving_pools_all_free(stack)


async def test_prompt_logprobs_arrive_once_across_a_worker_failover(new_cluster, llm):
    """Streams that asked for prompt logprobs lose their worker after their first tokens: each
    client got the prompt's logprobs once, as the in-process engine computes them, and its
    resumed request (it recomputes prompt + outputs elsewhere) sends none again."""
    prompts = PROMPTS[:6]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=2)
    reference = llm.generate(prompts, params)
    stack = new_cluster(num_workers=2, num_schedulers=1)
    await settle(stack, [2])

    async def kill_busiest_worker() -> None:
        victim = await busiest_worker(stack)
        stack.kill(victim)

    gateways = [g.address for g in stack.live("gateway")]
    logs = await streams_with_a_fault(gateways, prompts, MAX_TOKENS, kill_busiest_worker,
                                      finish_within_s=FINISH_WITHIN_S, prompt_logprobs=2)
    assert_exactly_the_fault_free_outputs(logs, [r.token_ids for r in reference], MAX_TOKENS)
    for log, ref in zip(logs, reference, strict=True):
        assert [lp.token_id for lp in log.prompt_logprobs] == [lp.token_id for lp in ref.prompt_logprobs]
        expected_logprobs = [lp.logprob for lp in ref.prompt_logprobs]
        assert [lp.logprob for lp in log.prompt_logprobs] == pytest.approx(expected_logprobs, abs=1e-4)
    await assert_surviving_pools_all_free(stack)


# Bounded throughout so the tiny random model ends every object well inside max_tokens
STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "items": {"type": "array", "minItems": 3, "maxItems": 4, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "ok": {"type": "boolean"}},
        "required": ["sku", "ok"]}}}, "required": ["id", "items"]}


async def test_json_schema_streams_stay_exact_across_a_worker_kill(new_cluster, llm):
    """16 json_schema streams, the busiest worker killed mid-generation: each request resumes on
    the other worker, whose grammar matcher is rebuilt from the tokens already delivered, so every
    output index arrives once, the tokens equal a run without faults and every output parses and
    validates against its schema."""
    prompts = [f"Order {i}: the warehouse shipped" for i in range(16)]
    constraint = {"json": STRUCTURED_SCHEMA}
    expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(
        max_tokens=200, temperature=0.8, seed=21, structured_output=constraint))]
    stack = new_cluster(num_workers=2, num_schedulers=1)
    await settle(stack, [2])

    async def kill_busiest_worker() -> None:
        stack.kill(await busiest_worker(stack))

    gateways = [g.address for g in stack.live("gateway")]
    logs = await streams_with_a_fault(gateways, prompts, 200, kill_busiest_worker, finish_within_s=FINISH_WITHIN_S,
                                      temperature=0.8, ignore_eos=False, structured_output=constraint,
                                      per_stream=[{"seed": 21} for _ in prompts])
    tokenizer = llm.tokenizer
    for i, (log, want) in enumerate(zip(logs, expected, strict=True)):
        assert log.indices == list(range(len(want))), f"stream {i}: indices missing or repeated"
        assert log.tokens == want, f"stream {i}: tokens differ from the run without faults"
        assert log.finish_reason == "stop", f"stream {i}: {log.finish_reason}"
        text = tokenizer.decode(want, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), STRUCTURED_SCHEMA)
    await assert_surviving_pools_all_free(stack)


async def test_1_worker_1_scheduler_worker_dies_and_another_joins(new_cluster, expected, tiny_model_dir):
    """No worker at all for 5 s: the streams wait (none fails), then finish on the newcomer."""
    stack = new_cluster(num_workers=1, num_schedulers=1)
    await settle(stack, [1])

    async def kill_then_rejoin() -> None:
        stack.kill(stack.live("worker")[0])
        await asyncio.sleep(REJOIN_AFTER_S)
        newcomer = start_worker(stack, tiny_model_dir, "worker-rejoined")
        await asyncio.to_thread(stack.wait_serving, newcomer, timeout_s=120)

    await run_and_check(stack, expected, kill_then_rejoin)
    await assert_surviving_pools_all_free(stack)


async def test_3_workers_2_schedulers_kill_the_lone_worker(new_cluster, expected):
    """Kill the only worker of the scheduler that drives one: its requests go back to the group at
    once; the fair share (ceil(2 / 2) = 1) then hands it one of the other's two workers."""
    stack = new_cluster(num_workers=3, num_schedulers=2)
    driven = await settle(stack, [1, 2])
    lone = next(addresses[0] for addresses in driven.values() if len(addresses) == 1)

    async def kill_lone_worker() -> None:
        held = await held_requests(stack)
        assert held.get(lone, 0) > 0, f"the lone worker holds no request ({held})"
        stack.kill(worker_at(stack, lone))

    await run_and_check(stack, expected, kill_lone_worker)
    await assert_surviving_pools_all_free(stack)
    await settle(stack, [1, 1])  # the fair share holds again: one worker each


async def test_kill_both_workers_of_one_scheduler(new_cluster, expected):
    """3 workers, 2 schedulers: kill the two workers of one scheduler while the third lives."""
    stack = new_cluster(num_workers=3, num_schedulers=2)
    driven = await settle(stack, [1, 2])
    pair = next(addresses for addresses in driven.values() if len(addresses) == 2)

    async def kill_pair() -> None:
        held = await held_requests(stack)
        assert sum(held.get(a, 0) for a in pair) > 0, f"the pair holds no request ({held})"
        for address in pair:
            stack.kill(worker_at(stack, address))

    await run_and_check(stack, expected, kill_pair)
    await assert_surviving_pools_all_free(stack)


async def test_2_workers_2_schedulers_both_die_and_one_joins(new_cluster, expected, tiny_model_dir):
    """No worker anywhere for 5 s, two schedulers holding requests (one may have handed its
    requests back on a stale view of the other): every stream waits, then finishes on the
    newcomer, whichever scheduler drives it."""
    stack = new_cluster(num_workers=2, num_schedulers=2)
    await settle(stack, [1, 1])

    async def kill_both_then_rejoin() -> None:
        for worker in stack.live("worker"):
            stack.kill(worker)
        await asyncio.sleep(REJOIN_AFTER_S)
        newcomer = start_worker(stack, tiny_model_dir, "worker-rejoined")
        await asyncio.to_thread(stack.wait_serving, newcomer, timeout_s=120)

    await run_and_check(stack, expected, kill_both_then_rejoin)
    await assert_surviving_pools_all_free(stack)
