"""The gateway's OpenAI-compatible HTTP API, driven by the official ``openai`` client (async, and
sync in a thread: the stack runs on this test's event loop) against the in-process stack."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest

import pagedserve
from pagedserve.aio_client import AsyncClient
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.sampling_params import SamplingParams

from helpers.metrics import scrape
from helpers.stack import queue_limited_gateway, scheduler_stats, wait_until_kv_free

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def async_client(stack, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=60, **kwargs)


def http(stack, method: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
    """A plain HTTP call (stdlib), for the endpoints outside OpenAI's client."""
    url = stack.http_url.removesuffix("/v1") + path
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            status, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


async def test_greedy_completion_equals_grpc_sdk_and_llm_generate(stack, llm):
    prompt = "The quick brown fox jumps over the lazy dog"
    expected = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    async with async_client(stack) as client:
        got = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=24, **GREEDY)
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        over_grpc = await sdk.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True)

    assert got.object == "text_completion" and got.model == stack.model
    assert got.choices[0].text == over_grpc.text == expected.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == 24
    assert got.usage.total_tokens == got.usage.prompt_tokens + 24


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_streamed_text_equals_whole_text_with_one_finish_reason_per_choice(stack, chat):
    async with async_client(stack) as client:
        if chat:
            create = client.chat.completions.create
            kwargs = dict(messages=[{"role": "user", "content": "Tell me a story"}])
        else:
            create = client.completions.create
            kwargs = dict(prompt="Once upon a time")
        whole = await create(model=stack.model, max_tokens=20, n=2, **kwargs, **GREEDY)
        stream = await create(model=stack.model, max_tokens=20, n=2, stream=True, **kwargs, **GREEDY)
        texts, finishes, first_deltas = {0: "", 1: ""}, {0: [], 1: []}, {}
        async for chunk in stream:
            assert chunk.object == ("chat.completion.chunk" if chat else "text_completion")
            for choice in chunk.choices:
                piece = choice.delta.content if chat else choice.text
                first_deltas.setdefault(choice.index, choice.delta if chat else None)
                texts[choice.index] += piece or ""
                if choice.finish_reason is not None:
                    finishes[choice.index].append(choice.finish_reason)

    whole_texts = {c.index: (c.message.content if chat else c.text) for c in whole.choices}
    assert texts == whole_texts
    assert whole_texts[0] == whole_texts[1]  # greedy: both samples alike
    assert finishes == {0: ["length"], 1: ["length"]}
    if chat:
        assert all(d.role == "assistant" for d in first_deltas.values())
        assert whole.choices[0].message.role == "assistant"


async def test_sync_client_chat_equals_llm_chat(stack, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    expected = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]

    def call():
        with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=60) as client:
            return client.chat.completions.create(model=stack.model, messages=messages, max_completion_tokens=12,
                                                  **GREEDY)
    got = await asyncio.to_thread(call)
    assert got.object == "chat.completion"
    assert got.choices[0].message.content == expected.text
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)


async def test_continue_final_message_continues_the_assistant_turn_as_llm_chat_does(stack, llm, hf_tokenizer):
    messages = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "My favourite is"}]
    expected = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        add_generation_prompt=False, continue_final_message=True)[0]
    template = hf_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert expected.prompt == template and template.rstrip().endswith("My favourite is")
    async with async_client(stack) as client:
        got = await client.chat.completions.create(
            model=stack.model, messages=messages, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True})
        with pytest.raises(openai.BadRequestError) as both:  # vLLM refuses the pair too
            await client.chat.completions.create(model=stack.model, messages=messages, max_tokens=2,
                                                 extra_body={"continue_final_message": True})
        with pytest.raises(openai.BadRequestError) as not_assistant:
            await client.chat.completions.create(
                model=stack.model, messages=messages[:1], max_tokens=2,
                extra_body={"add_generation_prompt": False, "continue_final_message": True})
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:  # the same over gRPC
        over_grpc = await sdk.chat(messages, max_tokens=8, temperature=0, ignore_eos=True,
                                   add_generation_prompt=False, continue_final_message=True)
        default = await sdk.chat(messages[:1], max_tokens=2)  # unset: the generation prompt is added
        with pytest.raises(InvalidArgumentError) as on_text:
            await sdk.generate("plain text", continue_final_message=True)
    assert got.choices[0].message.content == over_grpc.text == expected.text
    assert got.usage.prompt_tokens == over_grpc.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert default.usage.prompt_tokens == len(llm.chat(messages[:1], SamplingParams(max_tokens=1))[0].prompt_token_ids)
    assert on_text.value.field == "continue_final_message"
    assert both.value.body["param"] == not_assistant.value.body["param"] == "continue_final_message"
    status, tokens = await asyncio.to_thread(http, stack, "POST", "/tokenize", {
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True})
    assert status == 200 and tokens["tokens"] == list(expected.prompt_token_ids)


async def test_truncate_prompt_tokens_generates_from_the_last_n_tokens(stack, llm):
    ids = list(range(1000, 1020))
    expected = llm.generate([ids[-5:]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    messages = [{"role": "user", "content": "Tell me about the sea. " * 8}]
    async with async_client(stack) as client:
        got = await client.completions.create(model=stack.model, prompt=ids, max_tokens=6,
                                              extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5},
                                              temperature=0)
        chat = await client.chat.completions.create(model=stack.model, messages=messages,
                                                    extra_body={"truncate_prompt_tokens": 12})
        with pytest.raises(openai.BadRequestError) as zero:
            await client.completions.create(model=stack.model, prompt=ids, max_tokens=2,
                                            extra_body={"truncate_prompt_tokens": 0})
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        over_grpc = await sdk.generate(ids, max_tokens=6, temperature=0, ignore_eos=True, truncate_prompt_tokens=5)
    assert got.choices[0].text == over_grpc.text == expected.text
    assert got.usage.prompt_tokens == over_grpc.usage.prompt_tokens == 5
    # chat without max_tokens: the room is what the truncated prompt leaves
    assert chat.usage.prompt_tokens == 12 and chat.choices[0].finish_reason in ("stop", "length")
    assert zero.value.body["param"] == "truncate_prompt_tokens"


async def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(stack):
    async with async_client(stack) as client:
        plain = await client.completions.create(model=stack.model, prompt="Hello", max_tokens=4, logprobs=2, **GREEDY)
        by_id = await client.completions.create(model=stack.model, prompt="Hello", max_tokens=4, logprobs=2,
                                                temperature=0,
                                                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        chat = await client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True,
            top_logprobs=2, temperature=0, extra_body={"return_tokens_as_token_ids": True})
    assert by_id.choices[0].text == plain.choices[0].text  # the text itself is unchanged
    lp = by_id.choices[0].logprobs
    assert all(t.startswith("token_id:") and t[9:].isdigit() for t in lp.tokens) and len(lp.tokens) == 4
    assert lp.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert lp.text_offset == plain.choices[0].logprobs.text_offset  # offsets count the text, not the names
    assert all(all(k.startswith("token_id:") for k in top) for top in lp.top_logprobs)
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:") and bytes(entry.bytes).decode() == entry.token
        assert all(t.token.startswith("token_id:") for t in entry.top_logprobs)


async def test_n_samples_differ_and_a_seeded_call_reproduces(stack):
    async with async_client(stack) as client:
        async def sample():
            return await client.completions.create(model=stack.model, prompt="Pick a word:", max_tokens=12, n=3,
                                                   temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
        a, b = await sample(), await sample()
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # seed + j per sample: the samples differ
    assert a.usage.completion_tokens == 36


async def test_include_usage_sends_one_last_chunk_with_exact_counts(stack, hf_tokenizer):
    prompt = "Counting sheep: one, two"
    async with async_client(stack) as client:
        stream = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=9, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY)
        chunks = [c async for c in stream]
    *body, last = chunks
    assert last.choices == [] and all(c.usage is None for c in body)
    assert last.usage.prompt_tokens == len(hf_tokenizer(prompt)["input_ids"])
    assert last.usage.completion_tokens == 9
    assert last.usage.total_tokens == last.usage.prompt_tokens + 9


async def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(stack, hf_tokenizer):
    prompt = "Counting sheep: one, two"
    num_prompt = len(hf_tokenizer(prompt)["input_ids"])
    async with async_client(stack) as client:
        stream = await client.completions.create(
            model=stack.model, prompt=prompt, max_tokens=7, n=2, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, temperature=1.0, seed=5,
            extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        plain = await client.completions.create(
            model=stack.model, prompt=prompt, max_tokens=3, stream=True,
            stream_options={"continuous_usage_stats": True}, **GREEDY)  # without include_usage: no usage
        plain_chunks = [c async for c in plain]
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 14
    seen = {0: 0, 1: 0}
    for chunk in body:
        (choice,) = chunk.choices
        assert chunk.usage.prompt_tokens == num_prompt
        assert chunk.usage.total_tokens == num_prompt + chunk.usage.completion_tokens
        assert chunk.usage.completion_tokens >= seen[choice.index]  # counts of that choice, never back
        seen[choice.index] = chunk.usage.completion_tokens
    assert seen == {0: 7, 1: 7}
    assert all(c.usage is None for c in plain_chunks) and "".join(c.choices[0].text for c in plain_chunks)


async def test_a_repeated_prompt_reports_cached_tokens(stack):
    prompt = "A long shared system prompt that fills several KV blocks of the cache. " * 4
    async with async_client(stack) as client:
        first = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=2, **GREEDY)
        second = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=2, **GREEDY)
    block = stack.worker.info.block_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= block and cached % block == 0 and cached < second.usage.prompt_tokens


async def test_logprobs_are_present_and_bounded(stack):
    async with async_client(stack) as client:
        completion = await client.completions.create(model=stack.model, prompt="Hello", max_tokens=5, logprobs=3,
                                                     **GREEDY)
        chat = await client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(p <= 0 for p in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 and all(p <= 0 for p in top.values()) for top in lp.top_logprobs)
    assert "".join(lp.tokens) == completion.choices[0].text
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the best one


async def test_a_stop_token_id_ends_the_output_without_its_text_as_in_vllm(stack, llm, hf_tokenizer):
    """The token that ends an output as a stop token stays in the token ids, its text is left out
    (unless include_stop_str_in_output) and the id is the stop_reason — the same in process, over the
    SDK and over HTTP."""
    prompt = "Counting: one two three"
    greedy = dict(temperature=0, ignore_eos=True)
    ref = llm.generate([prompt], SamplingParams(max_tokens=12, **greedy))[0].token_ids
    k = next(i for i in range(3, 12) if ref[i] not in ref[:i])  # its first appearance ends the output
    stop_id = ref[k]
    before = llm.generate([prompt], SamplingParams(max_tokens=k, **greedy))[0].text  # the text of ref[:k]
    local = llm.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop_id], **greedy))[0]
    assert (local.token_ids, local.text, local.finish_reason, local.stop_token_id) == (ref[:k + 1], before, "stop",
                                                                                        stop_id)
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        done = await sdk.generate(prompt, max_tokens=12, stop_token_ids=[stop_id], **greedy)
    assert (list(done.token_ids), done.text, done.finish_reason, done.stop_token_id) == (ref[:k + 1], before, "stop",
                                                                                          stop_id)
    async with async_client(stack) as client:
        whole = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
        kept = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True, "stop_token_ids": [stop_id],
                                                           "include_stop_str_in_output": True})
    at_limit = llm.generate([prompt], SamplingParams(max_tokens=k + 1, stop_token_ids=[stop_id], **greedy))[0]
    assert (at_limit.text, at_limit.finish_reason, at_limit.stop_token_id) == (before, "stop", stop_id)
    choice = whole.model_dump()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (before, "stop", stop_id)
    assert kept.choices[0].text == before + hf_tokenizer.decode([stop_id])


async def test_stop_strings_are_never_shown(stack, llm):
    prompt = "Counting: one two three"
    reference = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].text
    stop = reference[10:13]
    async with async_client(stack) as client:
        whole = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=30, stop=[stop],
                                                **GREEDY)
        stream = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=30, stop=stop,
                                                 stream=True, **GREEDY)
        pieces = [c.choices[0].text async for c in stream if c.choices]
        kept = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=30, stop=[stop],
                                               temperature=0,
                                               extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    cut = reference.index(stop)
    assert whole.choices[0].text == "".join(pieces) == reference[:cut]
    assert whole.choices[0].finish_reason == "stop"
    assert all(stop not in p for p in pieces)
    assert kept.choices[0].text == reference[:cut] + stop


BAD_INPUTS = [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=100_000), "max_tokens"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(logit_bias={"42": 500}), "logit_bias"),
    (dict(logit_bias={"99999999": 1}), "logit_bias"),  # outside the vocabulary
    (dict(suffix="tail"), "suffix"),
    (dict(best_of=3), "best_of"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(extra_body={"no_such_param": 1}), "no_such_param"),
    (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(extra_body={"stop_token_ids": ["x"]}), "stop_token_ids"),
    (dict(extra_body={"min_tokens": 50}, max_tokens=4), "min_tokens"),
    (dict(extra_body={"request_id": "bad id!"}), "request_id"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[10**9]), "prompt_token_ids"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_INPUTS, ids=[p for _k, p in BAD_INPUTS])
async def test_each_bad_input_is_a_400_naming_its_param_and_the_server_keeps_serving(stack, kwargs, param):
    args = dict(model=stack.model, prompt="Hello", max_tokens=4)
    args.update(kwargs)
    async with async_client(stack) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(**args)
        assert caught.value.status_code == 400
        assert caught.value.body["param"] == param, caught.value.body
        assert caught.value.body["type"] == "BadRequestError"
        ok = await client.completions.create(model=stack.model, prompt="Hello", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
], ids=["empty", "role", "content", "tools", "top_logprobs-alone", "image"])
async def test_bad_chat_input_is_a_400_naming_its_param(stack, body, param):
    status, reply = await asyncio.to_thread(http, stack, "POST", "/v1/chat/completions",
                                            {"model": stack.model, "max_tokens": 2, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


async def test_unknown_model_is_a_404_and_bad_json_a_400(stack):
    async with async_client(stack) as client:
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="no-such-model", prompt="Hello", max_tokens=2)
    request = urllib.request.Request(stack.http_url + "/completions", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        await asyncio.to_thread(urllib.request.urlopen, request, None, 10)
    assert caught.value.code == 400 and json.loads(caught.value.read())["error"]["param"] == "body"
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # was a 500 (RecursionError)
    request = urllib.request.Request(stack.http_url + "/completions", data=deep, method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        await asyncio.to_thread(urllib.request.urlopen, request, None, 10)
    error = json.loads(caught.value.read())["error"]
    assert caught.value.code == 400 and error["message"] == "body: arrays and objects nested deeper than 64 levels"
    # within the parser's limit but past ours: the chat template's kwargs were a 500 (transformers recursed)
    kwargs = '{"a": ' * 900 + "1" + "}" * 900
    status, reply = await asyncio.to_thread(http, stack, "POST", "/v1/chat/completions", {
        "model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": json.loads(kwargs)})
    assert status == 400 and reply["error"]["param"] == "body", reply
    for body in (b'{"prompt": "\\ud800abc", "max_tokens": 2}', b'{"prompt": "hi", "stop": ["\\udfff"]}'):
        request = urllib.request.Request(stack.http_url + "/completions", data=body, method="POST",  # were 500s
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            await asyncio.to_thread(urllib.request.urlopen, request, None, 10)
        error = json.loads(caught.value.read())["error"]
        assert caught.value.code == 400 and "a lone surrogate" in error["message"] and error["param"] == "body"
    # a body declared as a form (urllib's and curl -d's default) is refused, as vLLM does
    request = urllib.request.Request(stack.http_url + "/completions", data=b'{"prompt": "Hi"}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        await asyncio.to_thread(urllib.request.urlopen, request, None, 10)
    error = json.loads(caught.value.read())["error"]
    assert caught.value.code == 400 and error["param"] == "content-type", error
    assert "application/json" in error["message"]
    # Starlette's own refusals come in the same error shape.
    status, reply = await asyncio.to_thread(http, stack, "GET", "/v1/no-such-route")
    assert status == 404 and reply["error"]["type"] == "NotFoundError", reply
    assert "/v1/no-such-route" in reply["error"]["message"]
    status, reply = await asyncio.to_thread(http, stack, "GET", "/v1/completions")
    assert status == 405 and reply["error"]["code"] == 405, reply


async def test_empty_turns_and_zero_logprobs_as_openai_clients_send_them(stack):
    """An empty system prompt and an assistant turn with no text are turns like others; completions'
    ``logprobs: 0`` gives each position's sampled token alone (OpenAI: up to logprobs + 1)."""
    async with async_client(stack) as client:
        chat = await client.chat.completions.create(
            model=stack.model, max_tokens=2,
            messages=[{"role": "system", "content": ""}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": ""}, {"role": "user", "content": "Hi again"}])
        done = await client.completions.create(model=stack.model, prompt="Hello", max_tokens=3, logprobs=0,
                                               temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    lp = done.choices[0].logprobs
    assert [len(top) for top in lp.top_logprobs] == [1] * len(lp.tokens) == [1] * done.usage.completion_tokens
    assert all(top == {token: p} for top, token, p in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))


async def test_a_chat_overflow_names_max_completion_tokens_when_that_was_sent(stack):
    async with async_client(stack) as client:
        for field in ("max_completion_tokens", "max_tokens"):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "Hi"}],
                                                     **{field: stack.worker.info.max_model_len})
            error = caught.value.body
            assert error["param"] == field and "maximum context length" in error["message"], error
            assert f"lower {field} to at most" in error["message"], error


async def test_models_health_tokenize_and_detokenize(stack, hf_tokenizer):
    async with async_client(stack) as client:
        models = await client.models.list()
        model = await client.models.retrieve(stack.model)  # GET /v1/models/{model}, a path with slashes here
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("no-such-model")
    assert [m.id for m in models.data] == [stack.model] and model.id == stack.model
    assert model.model_dump()["max_model_len"] == stack.worker.info.max_model_len
    status, listed = await asyncio.to_thread(http, stack, "GET", "/v1/models/")
    assert status == 200 and [m["id"] for m in listed["data"]] == [stack.model]
    assert (await asyncio.to_thread(http, stack, "GET", "/health"))[0] == 200
    assert (await asyncio.to_thread(http, stack, "GET", "/ping"))[0] == 200
    assert (await asyncio.to_thread(http, stack, "GET", "/livez"))[0] == 200
    assert (await asyncio.to_thread(http, stack, "POST", "/ping"))[0] == 200
    status, version = await asyncio.to_thread(http, stack, "GET", "/version")
    assert status == 200 and version == {"version": pagedserve.__version__}
    status, tokens = await asyncio.to_thread(http, stack, "POST", "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and tokens["tokens"] == hf_tokenizer("Hello world")["input_ids"]
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == stack.worker.info.max_model_len
    status, text = await asyncio.to_thread(http, stack, "POST", "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and text["prompt"] == "Hello world"
    status, chat = await asyncio.to_thread(http, stack, "POST", "/tokenize",
                                           {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and chat["count"] > 2
    messages = [{"role": "user", "content": "Hi"}]
    status, bare = await asyncio.to_thread(http, stack, "POST", "/tokenize",
                                           {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and bare["tokens"] == hf_tokenizer.encode(
        hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False),
        add_special_tokens=False)
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and chat["count"] > bare["count"]
    status, plain = await asyncio.to_thread(http, stack, "POST", "/tokenize",
                                            {"prompt": "Hello world", "add_special_tokens": False})
    assert status == 200 and plain["tokens"] == hf_tokenizer("Hello world", add_special_tokens=False)["input_ids"]


async def test_client_disconnect_mid_stream_aborts_and_frees_kv_blocks(stack):
    aborts = dict(model_name=stack.model, finished_reason="abort")
    before = await scrape(stack.gateway.http_port)
    async with async_client(stack) as client:
        stream = await client.completions.create(model=stack.model, prompt="A very long story begins",
                                                 max_tokens=400, stream=True, **GREEDY)
        got = 0
        async for chunk in stream:
            got += 1
            if got >= 3:
                break
        during = await scheduler_stats(stack.scheduler_address)
        assert during.num_running >= 1
        aborted_before = during.num_aborted
        await stream.close()

    stats = await wait_until_kv_free(stack.scheduler_address)
    for _ in range(100):  # the scheduler counts the abort just after it frees the blocks
        if stats.num_aborted > aborted_before:
            break
        await asyncio.sleep(0.02)
        stats = await scheduler_stats(stack.scheduler_address)
    assert stats.num_aborted == aborted_before + 1
    assert stats.workers[0].num_free_blocks == stats.workers[0].num_total_blocks
    after = await scrape(stack.gateway.http_port)
    assert after.get("pagedserve:request_success_total", **aborts) == before.get(
        "pagedserve:request_success_total", **aborts) + 1


async def test_a_full_queue_is_a_429(stack, hf_tokenizer):
    """A key prefix with no scheduler: requests wait in Redis; the third one is refused."""
    async with queue_limited_gateway(stack, hf_tokenizer, "qlimit-http:", 2) as (gateway, redis, keys):
        base_url = f"http://127.0.0.1:{gateway.http_port}/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30) as client:
            waiting = [asyncio.create_task(client.completions.create(model=stack.model, prompt=f"queued {i}",
                                                                     max_tokens=4)) for i in range(2)]
            while await redis.xlen(keys.requests) < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as caught:
                await client.completions.create(model=stack.model, prompt="one too many", max_tokens=4)
            assert caught.value.status_code == 429 and caught.value.body["type"] == "RateLimitError"
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        while gateway.service.in_flight:  # the disconnects reach the server and end both waiting calls
            await asyncio.sleep(0.01)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def grpc_health(port: int) -> tuple[str, str]:
    """The gateway's grpc.health.v1 statuses: the whole server ("": liveness) and the Generation
    service (readiness)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from servicekit.proto.pb import GENERATION_SERVICE

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        replies = [await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                   for name in ("", GENERATION_SERVICE)]
    return tuple(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status) for r in replies)


async def test_health_is_ready_only_when_a_completion_can_be_served(stack, hf_tokenizer):
    """/health (and /ping, /readyz) is readiness: 503 naming what is missing while no worker of the model is
    registered, or one is but no scheduler drives it; 200 on the serving stack. /livez is 200 all
    along (the process answers). Over gRPC the same: the Generation service's health status is
    readiness, the whole server's ("") liveness."""
    from gateway_service.config import GatewayConfig
    from gateway_service.main import GatewayApp

    alone = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=0, redis_url=stack.redis_url,
                                     key_prefix="health-none:"), hf_tokenizer=hf_tokenizer)
    await alone.start()
    try:
        status, said = await asyncio.to_thread(get, alone.http_port, "/health")
        assert status == 503 and "no worker serving" in said, said
        assert (await asyncio.to_thread(get, alone.http_port, "/livez"))[0] == 200
        assert await grpc_health(alone.port) == ("SERVING", "NOT_SERVING")
    finally:
        await alone.drain(1)
    async with queue_limited_gateway(stack, hf_tokenizer, "health-undriven:", 2) as (gateway, _redis, _keys):
        for path in ("/health", "/ping", "/readyz"):
            status, said = await asyncio.to_thread(get, gateway.http_port, path)
            assert status == 503 and "no scheduler drives" in said, said
        assert (await asyncio.to_thread(get, gateway.http_port, "/livez"))[0] == 200
        assert await grpc_health(gateway.port) == ("SERVING", "NOT_SERVING")
    status, said = await asyncio.to_thread(http, stack, "GET", "/health")
    assert status == 200 and said["serving"] is True, said
    assert (await asyncio.to_thread(http, stack, "GET", "/readyz"))[0] == 200
    assert await grpc_health(int(stack.gateway_address.rsplit(":", 1)[1])) == ("SERVING", "SERVING")
    # scale from zero: a gateway that lets requests wait for a worker is ready without one, and says so
    waiting = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=0, redis_url=stack.redis_url,
                                       key_prefix="health-zero:", worker_wait_s=30), hf_tokenizer=hf_tokenizer)
    await waiting.start()
    try:
        status, said = await asyncio.to_thread(get, waiting.http_port, "/health")
        said = json.loads(said)
        assert status == 200 and said["serving"] is False and "wait up to 30 s" in said["detail"], said
        assert await grpc_health(waiting.port) == ("SERVING", "SERVING")
    finally:
        await waiting.drain(1)


async def test_echo_and_cache_salt_are_applied(stack):
    prompt = "A salted prompt long enough to fill a couple of KV-cache blocks, or so one hopes. " * 3
    async with async_client(stack) as client:
        echoed = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=3, echo=True, **GREEDY)
        plain = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=3, **GREEDY)
        salted = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=3, temperature=0,
                                                 extra_body={"ignore_eos": True, "cache_salt": "tenant-b"})
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert plain.usage.prompt_tokens_details.cached_tokens > 0  # the echoed call cached the prompt
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # another salt shares no prefix
    assert salted.choices[0].text == plain.choices[0].text


async def test_a_draining_gateway_answers_503_and_finishes_live_http_streams(stack, hf_tokenizer):
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig

    gateway = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=0, redis_url=stack.redis_url,
                                         read_block_ms=200), hf_tokenizer=hf_tokenizer)
    await gateway.start()
    base_url = f"http://127.0.0.1:{gateway.http_port}/v1"
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as client:
        stream = await client.completions.create(model=stack.model, prompt="Drain me slowly", max_tokens=60,
                                                 stream=True, **GREEDY)
        chunks = [await stream.__anext__()]
        drain = asyncio.create_task(gateway.drain(grace_s=30))
        await asyncio.sleep(0.05)
        with pytest.raises(openai.APIStatusError) as caught:
            await client.completions.create(model=stack.model, prompt="too late", max_tokens=2)
        assert caught.value.status_code == 503
        chunks += [c async for c in stream]
        await asyncio.wait_for(drain, 30)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


async def test_a_drain_past_its_grace_answers_live_http_calls_503(stack, hf_tokenizer):
    """A whole (non-streamed) HTTP call still running when the drain grace ends gets OpenAI's 503
    error, not the ASGI server's bare 500 when it cancels the call."""
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig

    gateway = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=0, redis_url=stack.redis_url,
                                         read_block_ms=200), hf_tokenizer=hf_tokenizer)
    await gateway.start()
    base_url = f"http://127.0.0.1:{gateway.http_port}/v1"
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as client:
        call = asyncio.create_task(client.completions.create(model=stack.model, prompt="Drain me", max_tokens=400,
                                                             **GREEDY))
        while not gateway.service.in_flight:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(gateway.drain(grace_s=0.2), 30)
        with pytest.raises(openai.APIStatusError) as caught:
            await call
    assert caught.value.status_code == 503 and "shutting down" in caught.value.message, caught.value


async def test_a_body_past_the_limit_is_refused_by_its_size(stack, monkeypatch):
    """A body over MAX_BODY_BYTES is a 400 naming ``body`` whether it declares its length or comes
    chunked: then it is refused once that many bytes arrived, without waiting for (or holding) the
    rest, which here never comes."""
    from http.client import HTTPConnection
    from urllib.parse import urlsplit

    from gateway_service import http_api

    monkeypatch.setattr(http_api, "MAX_BODY_BYTES", 1000)
    status, reply = await asyncio.to_thread(http, stack, "POST", "/v1/completions", {"prompt": "x" * 5000})
    assert status == 400 and reply["error"]["param"] == "body", reply

    def chunked() -> tuple[int, dict]:
        url = urlsplit(stack.http_url)
        conn = HTTPConnection(url.hostname, url.port, timeout=30)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for piece in [b'{"prompt": "'] + [b"x" * 500] * 8:
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        reply = conn.getresponse()  # before the body's end: the gateway did not wait for all of it
        try:
            return reply.status, json.loads(reply.read())
        finally:
            conn.close()

    status, reply = await asyncio.to_thread(chunked)
    assert status == 400 and reply["error"]["param"] == "body", reply
    monkeypatch.undo()
    status, reply = await asyncio.to_thread(http, stack, "POST", "/v1/completions",
                                            {"model": stack.model, "prompt": "x" * 1600, "max_tokens": 1})
    assert status == 200, reply


async def test_logit_bias_bans_and_forces_tokens(stack, llm):
    """OpenAI's logit_bias through HTTP, the gateway, Redis and the worker's sampler: -100 keeps
    the greedy tokens away, +100 on one id makes every token that id."""
    expected = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    async with async_client(stack) as client:
        banned = await client.completions.create(
            model=stack.model, prompt=[5, 6, 7], max_tokens=6, temperature=0,
            logit_bias={str(t): -100 for t in set(expected.token_ids)}, extra_body={"ignore_eos": True})
        forced = await client.completions.create(
            model=stack.model, prompt=[5, 6, 7], max_tokens=6, temperature=1.0, seed=3,
            logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    reference = llm.generate([[5, 6, 7]] * 2, [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={t: -100 for t in expected.token_ids}),
        SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logit_bias={42: 100})])
    assert banned.choices[0].text == reference[0].text != expected.text
    assert not set(reference[0].token_ids) & set(expected.token_ids)
    assert reference[1].token_ids == [42] * 6 and forced.choices[0].text == reference[1].text


async def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(stack, llm):
    """lm-eval's loglikelihood: ``echo`` + ``logprobs`` + ``max_tokens: 1`` over token ids; the prompt's
    tokens come first (the first with ``null``), each scored as the in-process engine scores it; the
    same over the SDK (``prompt_logprobs``) and as vLLM's ``prompt_logprobs`` field, whole and streamed."""
    prompt = llm.tokenizer.encode("The capital of France is Paris and the capital of Spain is")
    local = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    expected = [lp.logprob for lp in local.prompt_logprobs]
    assert len(expected) == len(prompt) - 1
    async with async_client(stack) as client:
        got = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=1, logprobs=1,
                                              echo=True, temperature=0)
        lp = got.choices[0].logprobs
        lengths = {len(lp.tokens), len(lp.token_logprobs), len(lp.top_logprobs), len(lp.text_offset)}
        assert lengths == {len(prompt) + 1}
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        assert lp.token_logprobs[1:-1] == pytest.approx(expected, abs=1e-4)
        for token, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert 1 <= len(top) <= 2 and token <= max(top.values()) + 1e-6  # the token itself and the best one
        assert got.choices[0].text.startswith("The capital of France")
        assert lp.text_offset == sorted(lp.text_offset)

        vllm = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=2, temperature=0,
                                               extra_body={"prompt_logprobs": 2})
        entries = vllm.choices[0].model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt)
        for token_id, position, logprob in zip(prompt[1:], entries[1:], expected):
            mine = position[str(token_id)]
            assert mine["logprob"] == pytest.approx(logprob, abs=1e-4) and mine["rank"] >= 1
            assert 2 <= len(position) <= 3 and {e["rank"] for e in position.values()} >= {1, 2}

        stream = await client.completions.create(model=stack.model, prompt=prompt, max_tokens=3, logprobs=0,
                                                 echo=True, stream=True, temperature=0)
        streamed = [chunk.choices[0] async for chunk in stream if chunk.choices]
        assert streamed[0].logprobs.token_logprobs[0] is None
        assert streamed[0].logprobs.token_logprobs[1:len(prompt)] == pytest.approx(expected, abs=1e-4)
        assert sum(len(c.logprobs.tokens) for c in streamed) == len(prompt) + 3

        chat = await client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0,
            extra_body={"prompt_logprobs": 0})
        chat_entries = chat.model_extra["prompt_logprobs"]
        assert chat_entries[0] is None and chat.usage.prompt_tokens == len(chat_entries)
        assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in chat_entries[1:])

    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        over_grpc = await sdk.generate(prompt, max_tokens=1, temperature=0, prompt_logprobs=1)
    assert [lp.logprob for lp in over_grpc.prompt_logprobs] == pytest.approx(expected, abs=1e-4)
    assert [lp.token_id for lp in over_grpc.prompt_logprobs] == prompt[1:]


async def test_echo_with_max_tokens_0_gives_the_prompt_alone_scored(stack, llm):
    """OpenAI's legacy scoring call (lm-eval's older API models): echo, logprobs, max_tokens 0."""
    prompt = "Paris is the capital of"
    ids = llm.tokenizer.encode(prompt)
    local = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    async with async_client(stack) as client:
        for stream in (False, True):
            kwargs = dict(model=stack.model, prompt=prompt, max_tokens=0, echo=True, logprobs=0, stream=stream)
            if stream:
                chunks = [c.choices[0] async for c in await client.completions.create(**kwargs) if c.choices]
                text = "".join(c.text for c in chunks)
                token_logprobs = [p for c in chunks if c.logprobs for p in c.logprobs.token_logprobs]
                finish = chunks[-1].finish_reason
            else:
                got = await client.completions.create(**kwargs)
                text, token_logprobs = got.choices[0].text, got.choices[0].logprobs.token_logprobs
                finish = got.choices[0].finish_reason
                assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == len(ids)
            assert text == prompt and finish == "length"
            assert token_logprobs[0] is None and len(token_logprobs) == len(ids)
            assert token_logprobs[1:] == pytest.approx([lp.logprob for lp in local.prompt_logprobs], abs=1e-4)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await client.completions.create(model=stack.model, prompt=prompt, max_tokens=0)


async def test_prompt_logprobs_bounds(stack):
    async with async_client(stack) as client:
        for value in (-1, 21, "2"):
            with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
                await client.completions.create(model=stack.model, prompt="Hi", max_tokens=1,
                                                extra_body={"prompt_logprobs": value})


async def test_stop_token_ids_outside_the_vocabulary_are_refused_over_http_and_grpc(stack):
    async with AsyncClient(stack.gateway_address, timeout=30) as sdk:
        vocab = (await sdk.model_info()).vocab_size
        status, body = await asyncio.to_thread(http, stack, "POST", "/v1/completions",
                                               {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [1, vocab + 1]})
        assert status == 400 and body["error"]["param"] == "stop_token_ids", body
        assert f"token id {vocab + 1} is out of vocabulary" in body["error"]["message"]
        with pytest.raises(InvalidArgumentError) as caught:
            await sdk.generate("hi", max_tokens=2, stop_token_ids=[10**9])
    assert caught.value.field == "stop_token_ids"


async def _tenants_of_queued_requests(redis, keys, calls) -> list[str]:
    """Run ``calls`` (coroutines) against a gateway whose requests wait in Redis (no scheduler
    reads them); once all are queued, cancel them and return their records' tenants, sorted."""
    from servicekit.proto.queue import request_record_from_bytes
    from servicekit.redis_layout import DATA_FIELD

    tasks = [asyncio.create_task(call) for call in calls]
    while await redis.xlen(keys.requests) < len(tasks):
        await asyncio.sleep(0.01)
    entries = await redis.xrange(keys.requests)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return sorted(request_record_from_bytes(fields[DATA_FIELD.encode()]).tenant for _, fields in entries)


async def test_the_user_field_is_the_request_s_tenant_in_its_record(stack, hf_tokenizer):
    """Without API keys a request's tenant (the scheduler's fair share, --policy fair) is its user."""
    async with queue_limited_gateway(stack, hf_tokenizer, "tenant-http:", 4) as (gateway, redis, keys):
        base_url = f"http://127.0.0.1:{gateway.http_port}/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30) as client:
            tenants = await _tenants_of_queued_requests(redis, keys, [
                client.completions.create(model=stack.model, prompt="hi", max_tokens=2, **({"user": u} if u else {}))
                for u in ("team-a", "")])
    assert tenants == ["", "team-a"]


async def test_the_sdk_s_user_is_the_request_s_tenant_in_its_record(stack, hf_tokenizer):
    """The same over gRPC: the SDK's ``user`` argument."""
    async with queue_limited_gateway(stack, hf_tokenizer, "tenant-grpc:", 4) as (gateway, redis, keys):
        async with AsyncClient(f"127.0.0.1:{gateway.port}", timeout=30) as sdk:
            tenants = await _tenants_of_queued_requests(redis, keys, [
                sdk.generate("hi", max_tokens=2, **({"user": u} if u else {})) for u in ("team-b", "")])
    assert tenants == ["", "team-b"]