"""The public Generation gRPC service: a thin layer of protobuf -> domain -> protobuf around
:class:`~gateway_service.generation.GenerationService`. Errors are raised typed and mapped to
status codes by the shared interceptor (servicekit.serving)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from prometheus_client import CollectorRegistry

from gateway_service import convert
from gateway_service.generation import GenerationService
from gateway_service.multiplex import GenerateManyCall
from gateway_service.config import GatewayConfig
from servicekit.auth import KeyStore
from servicekit.grpc_auth import HEALTH_SERVICES, REFLECTION_SERVICES, BearerAuthInterceptor, caller_key_digest
from servicekit.proto.generation import model_info_to_pb
from servicekit.proto.pb import GENERATION_SERVICE, generation_pb2_grpc
from servicekit.serving import ServerLifecycle


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, service: GenerationService, settings: GatewayConfig | None = None) -> None:
        self._service = service
        self._settings = settings or GatewayConfig()

    async def Generate(self, request, context):
        inp = convert.generate_input_from_pb(request, self._service.sampling_defaults)
        # aclosing: a cancelled call (client gone, deadline) closes the generator at once, which
        # aborts the request in Redis.
        # The request belongs to the API key that admitted this call (only it may resume it).
        stream = self._service.generate(inp, timeout_s=context.time_remaining(), owner=caller_key_digest())
        async with aclosing(stream) as chunks:
            async for chunk in chunks:
                yield convert.chunk_to_pb(chunk)

    async def GenerateMany(self, request_iterator, context):
        call = GenerateManyCall(self._service, max_open=self._settings.max_concurrent_streams,
                                max_buffered=self._settings.max_buffered_outputs)
        async with aclosing(call.responses(request_iterator)) as responses:
            async for response in responses:
                yield response

    async def Tokenize(self, request, context):
        model, text, messages = convert.tokenize_input_from_pb(request)
        limits = await self._service.served_limits(model)
        token_ids = await self._service.tokenize(text, messages, limits)
        # Hundreds of thousands of ids take tens of ms to copy into the message: not on the loop.
        return await asyncio.to_thread(convert.tokenize_response_to_pb, token_ids)

    async def ModelInfo(self, request, context):
        return model_info_to_pb(await self._service.model_info())


def build_server(service: GenerationService, settings: GatewayConfig | None = None,
                 keys: KeyStore | None = None, registry: CollectorRegistry | None = None) -> ServerLifecycle:
    """The gateway's server: every Generation method needs an API key of ``keys`` (when it holds
    any); health and, unless ``settings.reflection`` is off, reflection stay open."""
    settings = settings or GatewayConfig()
    open_services = HEALTH_SERVICES + (REFLECTION_SERVICES if settings.reflection else ())
    size = settings.max_message_bytes
    lifecycle = ServerLifecycle(
        [GENERATION_SERVICE], interceptors=[BearerAuthInterceptor(keys or KeyStore(), open_services=open_services)],
        reflection_on=settings.reflection, registry=registry,
        options=[("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
                 ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
                 # Count open HTTP/2 streams, as the client does: it then queues calls past the limit.
                 # gRPC's default also counts streams the client already closed (a cancelled or
                 # finished call still unwinding here) and refuses new ones with REFUSED_STREAM, so a
                 # client at the limit saw refusals (of 1,000 concurrent streams on one connection,
                 # 139-381 failed after the SDK's retries).
                 ("grpc.http.overload_protection", 0)])
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(service, settings), lifecycle.server)
    return lifecycle
