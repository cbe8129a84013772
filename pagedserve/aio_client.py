"""The asyncio client SDK.

    async with AsyncClient("127.0.0.1:50051") as client:
        completion = await client.generate("The capital of France is", max_tokens=16, temperature=0)
        async with client.stream("Once upon a time", max_tokens=64) as stream:
            async for chunk in stream:
                print(chunk.text, end="")

Sampling arguments are SamplingParams' field names (``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logprobs``, ``prompt_logprobs``,
``logit_bias={token_id: bias}``) or a whole ``sampling_params=SamplingParams(...)``. Failures raise :mod:`pagedserve.errors` types.
A chat may continue a prefilled assistant turn as written: ``client.chat(messages,
add_generation_prompt=False, continue_final_message=True)`` (vLLM's switches).

API keys: ``AsyncClient(address, api_key="...")`` (default: the ``PAGEDSERVE_API_KEY`` environment
variable) sends ``authorization: Bearer <key>`` on every call; a request belongs to the key that
admitted it, so a resume needs the same key. TLS: ``tls=TlsFiles(ca_file=...)`` (with
``cert_file``/``key_file`` for a gateway that wants client certificates).

Give several gateways (``AsyncClient("g1:50051,g2:50051")``): a stream broken by a gateway
failure is resumed on the next one by request id from the next output index, so no token is lost
or repeated (:mod:`pagedserve.failover`).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from pagedserve import wire
from pagedserve.client_types import Chunk, Completion, ModelInfo
from pagedserve.errors import from_rpc_error
from pagedserve.failover import StreamCall, is_transient, parse_addresses
from pagedserve.multiplex import GenerateManyPool
from servicekit.auth import bearer_metadata
from servicekit.ports import GATEWAY_PORT
from servicekit.proto.channel import CHANNEL_OPTIONS
from servicekit.proto.generation import model_info_from_pb
from servicekit.proto.pb import generation_pb2, generation_pb2_grpc
from servicekit.tls import TlsFiles, aio_channel

DEFAULT_ADDRESS = f"127.0.0.1:{GATEWAY_PORT}"
# Reconnect quickly after a failed connect, so a retry can reach a gateway that just came up.
CLIENT_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
API_KEY_ENV = "PAGEDSERVE_API_KEY"
DEFAULT_RETRIES = 5  # consecutive tries without progress (backoff 0.2 s doubling, at most 2 s)


class AsyncStream(StreamCall):
    """An async iterator of :class:`Chunk`; ``aclose()`` (or leaving ``async with``) cancels the
    call, which aborts the request on the server. A call broken by a gateway failure is resumed on
    the next gateway (:mod:`pagedserve.failover`): every output index arrives exactly once."""

    def __init__(self, *args, pool: GenerateManyPool | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pool = pool  # the client's GenerateMany calls; None: a Generate call per stream

    def _start(self) -> None:
        if self._pool is None:
            super()._start()
            return
        timeout = self._failover.remaining() if self._timeout is not None else None
        self._call = self._pool.open(self._failover.address_index, self._request, timeout)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        if self._call is None:
            self._start()
        while True:
            try:
                msg = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                delay = self._failover.next_try(exc.code(), exc.details() or "")
                if delay is None:
                    self._done = True
                    raise from_rpc_error(exc) from None
                await asyncio.sleep(delay)
                self._start()
                continue
            if msg is grpc.aio.EOF:
                self._done = True
                raise StopAsyncIteration
            chunk = wire.chunk_from_pb(msg)
            self._failover.on_chunk(chunk.first_index, len(chunk.token_ids))
            if chunk.finish_reason is not None:
                self._done = True
            return chunk

    async def aclose(self) -> None:
        if self._call is not None and not self._done:
            self._call.cancel()
        self._done = True

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class GatewayClientBase:
    """What the sync and async clients share: one channel and stub per gateway address, and
    building a stream's request with a client-chosen id. Subclasses name their channel factory
    and stream class."""

    _stream_class: type[StreamCall]
    _open_channel: Callable[..., Any]  # (address, TlsFiles | None, options) -> channel

    def __init__(self, address: str | Sequence[str] = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 retries: int = DEFAULT_RETRIES, api_key: str | None = None, tls: TlsFiles | None = None) -> None:
        self.addresses = parse_addresses(address)
        self.address = self.addresses[0]
        self.timeout = timeout
        self.retries = retries
        self._metadata = bearer_metadata(api_key if api_key is not None else os.environ.get(API_KEY_ENV, ""))
        self._channels = [self._open_channel(a, tls, CLIENT_CHANNEL_OPTIONS) for a in self.addresses]
        self._stubs = [generation_pb2_grpc.GenerationStub(c) for c in self._channels]

    def stream(self, prompt=None, *, messages=None, request_id: str | None = None,
               timeout: float | None = None, **kwargs):
        """Stream one generation. ``prompt``: text or token ids; ``messages``: a chat. The request
        id is chosen here (unless given), so the stream can be resumed on another gateway."""
        request = wire.build_generate_request(
            prompt, messages=messages, request_id=request_id or uuid.uuid4().hex, **kwargs)
        return self._stream_class(self._stubs, request,
                                  timeout=timeout if timeout is not None else self.timeout,
                                  retries=self.retries, metadata=self._metadata, **self._stream_options())

    def _stream_options(self) -> dict[str, Any]:
        return {}


class AsyncClient(GatewayClientBase):
    """Channels to one or more gateways (``"h1:p1,h2:p2"`` or a list; streams fail over between
    them in order); safe to share between tasks. ``timeout`` is the default deadline of each call
    in seconds, all retries included (None: none). Streams share one GenerateMany call per gateway
    (one message per engine step for all of them; :mod:`pagedserve.multiplex`); ``multiplex=False``
    gives each its own Generate call."""

    _stream_class = AsyncStream
    _open_channel = staticmethod(aio_channel)

    def __init__(self, address: str | Sequence[str] = DEFAULT_ADDRESS, *, multiplex: bool = True, **kwargs) -> None:
        super().__init__(address, **kwargs)
        self._pool = GenerateManyPool(self._stubs, self._metadata) if multiplex else None

    def _stream_options(self) -> dict[str, Any]:
        return {"pool": self._pool}

    async def generate(self, prompt=None, **kwargs) -> Completion:
        """Generate and return the whole completion."""
        async with self.stream(prompt, **kwargs) as stream:
            chunks = [chunk async for chunk in stream]
        return Completion.from_chunks(chunks)

    async def chat(self, messages: list[dict[str, str]], **kwargs) -> Completion:
        """Continue a conversation (rendered with the model's chat template)."""
        return await self.generate(messages=messages, **kwargs)

    async def _unary(self, method: str, request):
        """Call ``method`` on the first gateway that answers (each address tried once)."""
        for i, stub in enumerate(self._stubs):
            try:
                return await getattr(stub, method)(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                if i + 1 == len(self._stubs) or not is_transient(exc.code(), exc.details() or ""):
                    raise from_rpc_error(exc) from None

    async def tokenize(self, text: str | None = None, *, messages=None) -> list[int]:
        reply = await self._unary("Tokenize", wire.build_tokenize_request(text, messages=messages))
        return list(reply.token_ids)

    async def model_info(self) -> ModelInfo:
        return model_info_from_pb(await self._unary("ModelInfo", generation_pb2.ModelInfoRequest()))

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


__all__ = ["AsyncClient", "AsyncStream"]
