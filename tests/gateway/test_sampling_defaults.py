"""A gateway's ``--sampling-defaults``: what the sampling fields a request leaves unset take, over
HTTP and gRPC, shown in ``/v1/models`` and ``ModelInfo``; explicit values win, field by field."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request

import openai
import pytest

from pagedserve.aio_client import AsyncClient

pytestmark = [pytest.mark.service, pytest.mark.asyncio(loop_scope="session")]

PROMPT = "Once upon a time"
SEEDS = (1, 2, 3, 4)
DEFAULTS = {"temperature": 0.0, "top_k": 1}


@contextlib.asynccontextmanager
async def defaults_gateway(stack, hf_tokenizer, setting: str):
    """A second gateway on the stack's keys (its scheduler serves it) with ``--sampling-defaults``."""
    from gateway_service.config import GatewayConfig
    from gateway_service.main import GatewayApp

    gateway = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=0, redis_url=stack.redis_url,
                                       read_block_ms=200, drain_grace_s=2, sampling_defaults=setting),
                         hf_tokenizer=hf_tokenizer)
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.drain(1)


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.load(reply)


async def _texts(client: openai.AsyncOpenAI, model: str, extra: dict | None = None, **fields) -> list[str]:
    out = []
    for seed in SEEDS:
        got = await client.completions.create(model=model, prompt=PROMPT, max_tokens=12, seed=seed,
                                              extra_body={"ignore_eos": True, **(extra or {})}, **fields)
        out.append(got.choices[0].text)
    return out


async def test_unset_fields_take_the_defaults_and_explicit_values_win(stack, hf_tokenizer):
    async with defaults_gateway(stack, hf_tokenizer, json.dumps(DEFAULTS)) as gateway:
        url = f"http://127.0.0.1:{gateway.http_port}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
            greedy = await _texts(client, stack.model, temperature=0)
            unset = await _texts(client, stack.model)  # temperature 0 and top_k 1 by default
            # an explicit temperature of 1 samples only once top_k is given too (1 by default)
            hot_default_k = await _texts(client, stack.model, temperature=1.0)
            hot = await _texts(client, stack.model, temperature=1.0, extra={"top_k": -1})
            chat = await client.chat.completions.create(model=stack.model, max_tokens=8, seed=5,
                                                        messages=[{"role": "user", "content": PROMPT}])
            chat_greedy = await client.chat.completions.create(model=stack.model, max_tokens=8, temperature=0,
                                                               messages=[{"role": "user", "content": PROMPT}])
        async with AsyncClient(f"127.0.0.1:{gateway.port}", timeout=60) as sdk:
            over_grpc = [(await sdk.generate(PROMPT, max_tokens=12, seed=s, ignore_eos=True)).text for s in SEEDS]
            grpc_hot = [(await sdk.generate(PROMPT, max_tokens=12, seed=s, ignore_eos=True, temperature=1.0,
                                            top_k=-1)).text for s in SEEDS]
    assert len(set(greedy)) == 1
    assert unset == hot_default_k == over_grpc == greedy
    assert chat.choices[0].message.content == chat_greedy.choices[0].message.content
    assert set(hot) != {greedy[0]} and set(grpc_hot) != {greedy[0]}  # sampled: some seed leaves the greedy path


async def test_the_defaults_are_shown_in_models_and_model_info(stack, hf_tokenizer):
    async with defaults_gateway(stack, hf_tokenizer, json.dumps(DEFAULTS)) as gateway:
        card = (await asyncio.to_thread(_get_json, f"http://127.0.0.1:{gateway.http_port}/v1/models"))["data"][0]
        async with AsyncClient(f"127.0.0.1:{gateway.port}", timeout=60) as sdk:
            info = await sdk.model_info()
    assert card["sampling_defaults"] == {"temperature": 0.0, "top_k": 1.0}
    assert dict(info.sampling_defaults) == {"temperature": 0.0, "top_k": 1.0}


async def test_a_model_without_defaults_shows_none_and_samples(stack):
    """The tiny test model ships no sampling fields in its generation config: OpenAI's defaults."""
    async with AsyncClient(stack.gateway_address, timeout=60) as sdk:
        info = await sdk.model_info()
        texts = {(await sdk.generate(PROMPT, max_tokens=12, seed=s, ignore_eos=True)).text for s in SEEDS}
    assert info.sampling_defaults == ()
    assert len(texts) > 1


async def test_a_bad_setting_is_refused_by_name():
    from gateway_service.config import GatewayConfig
    from servicekit.contract.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="sampling_defaults: unknown fields temp"):
        GatewayConfig(model="m", sampling_defaults='{"temp": 0}')
