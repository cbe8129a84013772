"""The public Generation gRPC service: a thin layer of protobuf -> domain -> protobuf around
:class:`~gateway_service.generation.GenerationService`. Errors are raised typed and mapped to
status codes by the shared interceptor (servicekit.serving)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from prometheus_client import CollectorRegistry

from gateway_service import convert
from gateway_service.generation import GenerationService
from servicekit.proto.pb import GENERATION_SERVICE, generation_pb2_grpc
from servicekit.serving import ServerLifecycle


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, service: GenerationService) -> None:
        self._service = service

    async def Generate(self, request, context):
        inp = convert.generate_input_from_pb(request)
        # aclosing: a cancelled call (client gone, deadline) closes the generator at once, which
        # aborts the request in Redis.
        async with aclosing(self._service.generate(inp, timeout_s=context.time_remaining())) as chunks:
            async for chunk in chunks:
                yield convert.chunk_to_pb(chunk)

    async def Tokenize(self, request, context):
        model, text, messages = convert.tokenize_input_from_pb(request)
        limits = await self._service.served_limits(model)
        token_ids = await self._service.tokenize(text, messages, limits)
        # Hundreds of thousands of ids take tens of ms to copy into the message: not on the loop.
        return await asyncio.to_thread(convert.tokenize_response_to_pb, token_ids)

    async def ModelInfo(self, request, context):
        return convert.model_info_to_pb(await self._service.served_limits(""))


def build_server(service: GenerationService, registry: CollectorRegistry | None = None) -> ServerLifecycle:
    lifecycle = ServerLifecycle([GENERATION_SERVICE], registry=registry)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(service), lifecycle.server)
    return lifecycle
