"""The asyncio client SDK.

    async with AsyncClient("127.0.0.1:50051") as client:
        completion = await client.generate("The capital of France is", max_tokens=16, temperature=0)
        async with client.stream("Once upon a time", max_tokens=64) as stream:
            async for chunk in stream:
                print(chunk.text, end="")

Sampling arguments are SamplingParams' field names (``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logprobs``) or a whole
``sampling_params=SamplingParams(...)``. Failures raise :mod:`pagedserve.errors` types. A call
that fails with UNAVAILABLE before its first token is retried (same request id; if the first try
did reach Redis, the retry resumes it instead of running it twice).
"""

from __future__ import annotations

import asyncio
import uuid

import grpc

from pagedserve import convert
from pagedserve.client_types import Chunk, Completion, ModelInfo
from pagedserve.errors import from_rpc_error
from pagedserve.pb import generation_pb2, generation_pb2_grpc
from pagedserve.serving import CHANNEL_OPTIONS

DEFAULT_ADDRESS = "127.0.0.1:50051"
# Reconnect quickly after a failed connect, so a retry can reach a gateway that just came up.
CLIENT_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
DEFAULT_RETRIES = 3
RETRY_BACKOFF_S = 0.2  # doubled after each retry


class AsyncStream:
    """An async iterator of :class:`Chunk`; ``aclose()`` (or leaving ``async with``) cancels the
    call, which aborts the request on the server."""

    def __init__(self, stub, request, *, timeout: float | None, retries: int) -> None:
        self._stub = stub
        self._request = request
        self._timeout = timeout
        self._retries = retries
        self._call = None
        self._received = False
        self._done = False
        self.request_id = request.request_id

    def _start(self) -> None:
        self._call = self._stub.Generate(self._request, timeout=self._timeout)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        if self._call is None:
            self._start()
        attempt, backoff = 0, RETRY_BACKOFF_S
        while True:
            try:
                msg = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if not self._received and code == grpc.StatusCode.UNAVAILABLE and attempt < self._retries:
                    attempt += 1
                    await asyncio.sleep(backoff)
                    backoff *= 2
                    self._start()
                    continue
                if code == grpc.StatusCode.ALREADY_EXISTS and attempt and not self._received:
                    # An earlier try reached Redis before failing: follow that request instead.
                    self._request.resume_from_index = 0
                    self._start()
                    continue
                self._done = True
                raise from_rpc_error(exc) from None
            if msg is grpc.aio.EOF:
                self._done = True
                raise StopAsyncIteration
            self._received = True
            chunk = convert.chunk_from_pb(msg)
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


class AsyncClient:
    """One channel to a gateway; safe to share between tasks. ``timeout`` is the default deadline
    of each call in seconds (None: none)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 retries: int = DEFAULT_RETRIES) -> None:
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self._channel = grpc.aio.insecure_channel(address, options=CLIENT_CHANNEL_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def stream(self, prompt=None, *, messages=None, request_id: str | None = None,
               timeout: float | None = None, **kwargs) -> AsyncStream:
        """Stream one generation. ``prompt``: text or token ids; ``messages``: a chat."""
        request = convert.build_generate_request(
            prompt, messages=messages, request_id=request_id or uuid.uuid4().hex, **kwargs)
        return AsyncStream(self._stub, request, timeout=timeout if timeout is not None else self.timeout,
                           retries=self.retries)

    async def generate(self, prompt=None, **kwargs) -> Completion:
        """Generate and return the whole completion."""
        async with self.stream(prompt, **kwargs) as stream:
            chunks = [chunk async for chunk in stream]
        return Completion.from_chunks(chunks)

    async def chat(self, messages: list[dict[str, str]], **kwargs) -> Completion:
        """Continue a conversation (rendered with the model's chat template)."""
        return await self.generate(messages=messages, **kwargs)

    async def tokenize(self, text: str | None = None, *, messages=None) -> list[int]:
        try:
            reply = await self._stub.Tokenize(convert.build_tokenize_request(text, messages=messages),
                                              timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return list(reply.token_ids)

    async def model_info(self) -> ModelInfo:
        try:
            reply = await self._stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return convert.model_info_from_pb(reply)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


__all__ = ["AsyncClient", "AsyncStream"]
