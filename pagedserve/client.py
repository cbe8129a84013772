"""The blocking client SDK (see :mod:`pagedserve.aio_client` for the asyncio one).

    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=16, temperature=0).text)
        with client.stream("Once upon a time", max_tokens=64) as stream:
            for chunk in stream:
                print(chunk.text, end="", flush=True)

Arguments, API keys, TLS, errors, retries and gateway failover as in :mod:`pagedserve.aio_client`
(``Client("g1:50051,g2:50051")``).
"""

from __future__ import annotations

import time

import grpc

from pagedserve import wire
from pagedserve.aio_client import GatewayClientBase
from pagedserve.client_types import Chunk, Completion, ModelInfo
from pagedserve.errors import from_rpc_error
from pagedserve.failover import StreamCall, is_transient
from servicekit.proto.generation import model_info_from_pb
from servicekit.proto.pb import generation_pb2
from servicekit.tls import sync_channel


class Stream(StreamCall):
    """An iterator of :class:`Chunk`; ``close()`` (or leaving ``with``) cancels the call, which
    aborts the request on the server. A call broken by a gateway failure is resumed on the next
    gateway (:mod:`pagedserve.failover`): every output index arrives exactly once."""

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        if self._call is None:
            self._start()
        while True:
            try:
                msg = next(self._call)
            except StopIteration:
                self._done = True
                raise
            except grpc.RpcError as exc:
                delay = self._failover.next_try(exc.code(), exc.details() or "")
                if delay is None:
                    self._done = True
                    raise from_rpc_error(exc) from None
                time.sleep(delay)
                self._start()
                continue
            chunk = wire.chunk_from_pb(msg)
            self._failover.on_chunk(chunk.first_index, len(chunk.token_ids))
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


class Client(GatewayClientBase):
    """Channels to one or more gateways (``"h1:p1,h2:p2"`` or a list; streams fail over between
    them in order); safe to share between threads. ``timeout`` is the default deadline of each
    call in seconds, all retries included (None: none)."""

    _stream_class = Stream
    _open_channel = staticmethod(sync_channel)

    def generate(self, prompt=None, **kwargs) -> Completion:
        """Generate and return the whole completion."""
        with self.stream(prompt, **kwargs) as stream:
            chunks = list(stream)
        return Completion.from_chunks(chunks)

    def chat(self, messages: list[dict[str, str]], **kwargs) -> Completion:
        """Continue a conversation (rendered with the model's chat template)."""
        return self.generate(messages=messages, **kwargs)

    def _unary(self, method: str, request):
        """Call ``method`` on the first gateway that answers (each address tried once)."""
        for i, stub in enumerate(self._stubs):
            try:
                return getattr(stub, method)(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                if i + 1 == len(self._stubs) or not is_transient(exc.code(), exc.details() or ""):
                    raise from_rpc_error(exc) from None

    def tokenize(self, text: str | None = None, *, messages=None) -> list[int]:
        return list(self._unary("Tokenize", wire.build_tokenize_request(text, messages=messages)).token_ids)

    def model_info(self) -> ModelInfo:
        return model_info_from_pb(self._unary("ModelInfo", generation_pb2.ModelInfoRequest()))

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
