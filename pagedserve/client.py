"""The blocking client SDK (see :mod:`pagedserve.aio_client` for the asyncio one).

    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=16, temperature=0).text)
        with client.stream("Once upon a time", max_tokens=64) as stream:
            for chunk in stream:
                print(chunk.text, end="", flush=True)

Arguments, errors and retries as in :mod:`pagedserve.aio_client`.
"""

from __future__ import annotations

import time
import uuid

import grpc

from pagedserve import convert
from pagedserve.aio_client import CLIENT_CHANNEL_OPTIONS, DEFAULT_ADDRESS, DEFAULT_RETRIES, RETRY_BACKOFF_S
from pagedserve.client_types import Chunk, Completion, ModelInfo
from pagedserve.errors import from_rpc_error
from pagedserve.pb import generation_pb2, generation_pb2_grpc


class Stream:
    """An iterator of :class:`Chunk`; ``close()`` (or leaving ``with``) cancels the call, which
    aborts the request on the server."""

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

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        if self._call is None:
            self._start()
        attempt, backoff = 0, RETRY_BACKOFF_S
        while True:
            try:
                msg = next(self._call)
            except StopIteration:
                self._done = True
                raise
            except grpc.RpcError as exc:
                code = exc.code()
                if not self._received and code == grpc.StatusCode.UNAVAILABLE and attempt < self._retries:
                    attempt += 1
                    time.sleep(backoff)
                    backoff *= 2
                    self._start()
                    continue
                if code == grpc.StatusCode.ALREADY_EXISTS and attempt and not self._received:
                    self._request.resume_from_index = 0  # an earlier try got through: follow it
                    self._start()
                    continue
                self._done = True
                raise from_rpc_error(exc) from None
            self._received = True
            chunk = convert.chunk_from_pb(msg)
            if chunk.finish_reason is not None:
                self._done = True
            return chunk

    def close(self) -> None:
        if self._call is not None and not self._done:
            self._call.cancel()
        self._done = True

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client:
    """One channel to a gateway; safe to share between threads. ``timeout`` is the default
    deadline of each call in seconds (None: none)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = None,
                 retries: int = DEFAULT_RETRIES) -> None:
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self._channel = grpc.insecure_channel(address, options=CLIENT_CHANNEL_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def stream(self, prompt=None, *, messages=None, request_id: str | None = None,
               timeout: float | None = None, **kwargs) -> Stream:
        """Stream one generation. ``prompt``: text or token ids; ``messages``: a chat."""
        request = convert.build_generate_request(
            prompt, messages=messages, request_id=request_id or uuid.uuid4().hex, **kwargs)
        return Stream(self._stub, request, timeout=timeout if timeout is not None else self.timeout,
                      retries=self.retries)

    def generate(self, prompt=None, **kwargs) -> Completion:
        """Generate and return the whole completion."""
        with self.stream(prompt, **kwargs) as stream:
            chunks = list(stream)
        return Completion.from_chunks(chunks)

    def chat(self, messages: list[dict[str, str]], **kwargs) -> Completion:
        """Continue a conversation (rendered with the model's chat template)."""
        return self.generate(messages=messages, **kwargs)

    def tokenize(self, text: str | None = None, *, messages=None) -> list[int]:
        try:
            reply = self._stub.Tokenize(convert.build_tokenize_request(text, messages=messages), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return list(reply.token_ids)

    def model_info(self) -> ModelInfo:
        try:
            reply = self._stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return convert.model_info_from_pb(reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
