"""Generation through the whole stack (in-process services, real Redis, real gRPC, real model)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve.aio_client import AsyncClient
from servicekit.contract.sampling_params import SamplingParams

from helpers.stack import scheduler_stats, wait_until_kv_free

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]


async def test_streamed_greedy_generation_equals_llm_token_for_token(stack, llm):
    prompt = "The quick brown fox jumps over the lazy dog"
    expected = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]

    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        chunks = []
        async with client.stream(prompt, max_tokens=40, temperature=0, ignore_eos=True) as stream:
            async for chunk in stream:
                chunks.append(chunk)

    token_ids = [t for c in chunks for t in c.token_ids]
    assert token_ids == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text
    indices = [c.first_index for c in chunks if c.token_ids]
    assert indices == sorted(indices) and indices[0] == 0
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert last.usage.completion_tokens == 40
    assert last.usage.prompt_tokens == len(expected.prompt_token_ids)


async def test_chat_goes_through_the_template_like_llm_chat(stack, llm):
    messages = [{"role": "user", "content": "Say hello"}]
    expected = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        got = await client.chat(messages, max_tokens=12, temperature=0, ignore_eos=True)
        assert await client.tokenize(messages=messages) == expected.prompt_token_ids
    assert list(got.token_ids) == expected.token_ids
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)


async def test_32_concurrent_streams_finish_with_their_token_counts(stack):
    async with AsyncClient(stack.gateway_address, timeout=120) as client:
        async def one(i: int) -> tuple[int, int, str | None]:
            completion = await client.generate(f"Request number {i}:", max_tokens=8 + i, ignore_eos=True, seed=i)
            return len(completion.token_ids), completion.usage.completion_tokens, completion.finish_reason

        results = await asyncio.gather(*(one(i) for i in range(32)))
    assert results == [(8 + i, 8 + i, "length") for i in range(32)]


async def test_seeded_sampling_is_reproducible_through_the_stack(stack):
    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        a = await client.generate("Pick a word:", max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
        b = await client.generate("Pick a word:", max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    assert a.token_ids == b.token_ids


async def test_cancelled_stream_is_aborted_and_its_kv_blocks_freed(stack):
    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        stream = client.stream("A very long story begins", max_tokens=400, ignore_eos=True)
        got = 0
        async for chunk in stream:
            got += len(chunk.token_ids)
            if got >= 3:
                break
        during = await scheduler_stats(stack.scheduler_address)
        assert during.num_running >= 1 and during.workers[0].num_free_blocks < during.workers[0].num_total_blocks
        aborted_before = during.num_aborted
        await stream.aclose()

    stats = await wait_until_kv_free(stack.scheduler_address)
    assert stats.num_aborted == aborted_before + 1
    assert stats.workers[0].num_free_blocks == stats.workers[0].num_total_blocks


async def test_stop_string_ends_the_request_and_is_never_shown(stack, llm):
    prompt = "Counting: one two three"
    reference = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].text
    stop = reference[10:13]  # a stop string the greedy output is known to contain
    cut = reference.index(stop)
    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        chunks = [c async for c in client.stream(prompt, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])]
    text = "".join(c.text for c in chunks)
    assert text == reference[:cut]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_string == stop
    assert all(stop not in c.text for c in chunks)


async def test_in_process_and_served_engines_agree_on_stop_strings(stack, llm):
    """One text path (gateway_service.text) for both engines: the same requests with stop strings
    give the same text, tokens, finish reason and stop string through LLM.generate and the stack."""
    prompts = ["Counting: one two three", "The capital of France is", "Once upon a time"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    references = [o.text for o in llm.generate(prompts, greedy)]
    stops = [[ref[8:11]] for ref in references] + [["no such stop string here"]]
    cases = list(zip(prompts + prompts[:1], stops))
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=tuple(stop)) for _, stop in cases]

    in_process = llm.generate([p for p, _ in cases], params)
    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        served = [await client.generate(p, max_tokens=24, temperature=0, ignore_eos=True, stop=stop)
                  for p, stop in cases]

    for (prompt, stop), mine, theirs in zip(cases, in_process, served):
        assert mine.text == theirs.text, (prompt, stop)
        assert tuple(mine.token_ids) == theirs.token_ids
        assert mine.finish_reason == theirs.finish_reason
        assert mine.stop_string == theirs.stop_string
    assert [o.finish_reason for o in in_process] == ["stop", "stop", "stop", "length"]
    assert all(o.stop_string not in o.text for o in in_process[:3])


async def test_deadline_aborts_the_request_and_frees_its_blocks(stack):
    from pagedserve.errors import DeadlineExceededError

    async with AsyncClient(stack.gateway_address) as client:
        with pytest.raises(DeadlineExceededError):
            await client.generate("Never finishes in time", max_tokens=450, ignore_eos=True, timeout=0.5)
    await wait_until_kv_free(stack.scheduler_address)


async def test_a_call_whose_deadline_passes_while_redis_admits_it_still_aborts_it(stack, monkeypatch):
    """The deadline (or the client leaving) cancels the call with its admission in flight: once the
    admission lands the request is aborted, not left to run to max_tokens with nobody reading (seen
    under load with 0.3 s deadlines)."""
    from gateway_service.admission import Admission
    from pagedserve.errors import DeadlineExceededError

    admit = Admission.admit

    async def slow_reply(self, *args, **kwargs):
        await admit(self, *args, **kwargs)  # admitted in Redis; the reply comes late
        await asyncio.sleep(1.0)

    monkeypatch.setattr(Admission, "admit", slow_reply)
    before = (await scheduler_stats(stack.scheduler_address)).num_aborted
    async with AsyncClient(stack.gateway_address, retries=0) as client:
        with pytest.raises(DeadlineExceededError):
            await client.generate("Admitted too late to read", max_tokens=450, ignore_eos=True, timeout=0.3)
    deadline = time.monotonic() + 10
    while (await scheduler_stats(stack.scheduler_address)).num_aborted == before:
        assert time.monotonic() < deadline, "the request was never aborted"
        await asyncio.sleep(0.05)
    await wait_until_kv_free(stack.scheduler_address)


async def test_resume_streams_a_request_again_from_an_output_index(stack):
    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        original = await client.generate("Resume me", max_tokens=20, ignore_eos=True, seed=7,
                                         request_id="resume-test-1")
        resumed = await client.generate("Resume me", max_tokens=20, ignore_eos=True, seed=7,
                                        request_id="resume-test-1", resume_from_index=12)
    assert resumed.request_id == "resume-test-1"
    assert list(resumed.token_ids) == list(original.token_ids[12:])
    assert resumed.finish_reason == "length" and resumed.usage.completion_tokens == 20


async def test_a_request_id_in_use_is_refused_and_an_unknown_one_cannot_be_resumed(stack):
    from pagedserve.errors import AlreadyExistsError, NotFoundError

    async with AsyncClient(stack.gateway_address, timeout=60, retries=0) as client:
        await client.generate("once", max_tokens=2, request_id="dup-test-1")
        with pytest.raises(AlreadyExistsError):
            await client.generate("twice", max_tokens=2, request_id="dup-test-1")
        with pytest.raises(NotFoundError):
            await client.generate("who?", max_tokens=2, request_id="never-seen", resume_from_index=0)


async def test_allowed_token_ids_through_the_sdk_and_http(stack, llm):
    from pagedserve.errors import InvalidArgumentError

    from helpers.stack import post_json

    allowed = [11, 42, 300, 777]
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=4, ignore_eos=True, allowed_token_ids=allowed)
    expected = llm.generate(["Choose"], params)[0]
    assert set(expected.token_ids) <= set(allowed)
    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        got = await client.generate("Choose", max_tokens=6, temperature=0.9, seed=4, ignore_eos=True,
                                    allowed_token_ids=allowed)
        with pytest.raises(InvalidArgumentError) as outside:
            await client.generate("Choose", max_tokens=2, allowed_token_ids=[10**8])
        eos = (await client.model_info()).eos_token_ids
        with pytest.raises(InvalidArgumentError) as only_eos:
            await client.generate("Choose", max_tokens=4, min_tokens=2, allowed_token_ids=list(eos))
    assert only_eos.value.field == "allowed_token_ids"
    assert list(got.token_ids) == expected.token_ids
    assert outside.value.field == "allowed_token_ids"

    def http(body: dict) -> tuple[int, dict]:
        return post_json(stack.http_url + "/completions", body)
    status, reply = await asyncio.to_thread(http, {
        "prompt": "Choose", "max_tokens": 6, "temperature": 0.9, "seed": 4, "ignore_eos": True,
        "allowed_token_ids": allowed, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert status == 200
    assert [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]] == expected.token_ids
    status, reply = await asyncio.to_thread(http, {"prompt": "Choose", "max_tokens": 2, "allowed_token_ids": []})
    assert status == 400 and reply["error"]["param"] == "allowed_token_ids"


async def test_logit_bias_through_the_sdk(stack, llm):
    from pagedserve.errors import InvalidArgumentError

    params = SamplingParams(max_tokens=5, temperature=0.7, seed=2, ignore_eos=True, logit_bias={42: 100.0, 7: -3.5})
    expected = llm.generate(["Bias me"], params)[0]
    assert expected.token_ids == [42] * 5
    async with AsyncClient(stack.gateway_address, timeout=60) as client:
        got = await client.generate("Bias me", max_tokens=5, temperature=0.7, seed=2, ignore_eos=True,
                                    logit_bias={42: 100.0, 7: -3.5})
        assert list(got.token_ids) == expected.token_ids
        with pytest.raises(InvalidArgumentError) as caught:
            await client.generate("Bias me", max_tokens=2, logit_bias={-1: 5})
        assert caught.value.field == "logit_bias"
        with pytest.raises(InvalidArgumentError) as caught:
            await client.generate("Bias me", max_tokens=2, logit_bias={1: 1000})
        assert caught.value.field == "logit_bias"
