"""The gateway's OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions`` (whole
or as server-sent events), Anthropic's ``/v1/messages`` (and its ``count_tokens``;
:mod:`gateway_service.anthropic_messages`), ``/v1/models``, ``/health`` (readiness, also as ``/ping``), ``/livez``
(liveness), ``/version``, ``/tokenize``, ``/detokenize``, ``/metrics``, and OpenAI's Responses API
(``/v1/responses``: :mod:`gateway_service.responses_api`).

A thin layer like the gRPC servicer: JSON → :mod:`gateway_service.openai_params` → the one
:meth:`GenerationService.generate` path (admission, queue limit, detokenization, stop strings, abort
on disconnect) → :mod:`gateway_service.openai_responses` → JSON. Errors are the typed errors of
``servicekit.contract.errors``, turned into OpenAI's error shape in one place (:func:`_error`).

Why Starlette: it is the ASGI toolkit FastAPI (and so vLLM's server) is built on, without
FastAPI's pydantic request models, whose 422 answers would be a second validation with a second
error shape; our parameters are checked once, by the same code that checks gRPC requests, and
every refusal is a 400 naming the field.

Every request passes :func:`check_request` first: the one place its headers are checked before its
body is read (the place where authentication goes); reading the body checks its declared media type.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from importlib.metadata import version

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway_service.anthropic_messages import MessageEvents, message_events, message_json, parse_count_tokens
from gateway_service.anthropic_messages import error_body as anthropic_error_body
from gateway_service.anthropic_messages import error_json as anthropic_error_json
from gateway_service.anthropic_messages import parse_message
from gateway_service.generation import GenerationService
from gateway_service.messages import GenerateChunk, GenerateInput
from gateway_service.openai_params import (
    OpenAIRequest,
    chat_max_tokens,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from gateway_service.openai_responses import ChoiceState, Responder, TokenText, error_body, error_json
from servicekit.auth import KeyStore
from servicekit.contract.api import ModelInfo
from servicekit.contract.errors import CancelledError as ClientGone
from servicekit.contract.errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PagedServeError,
    UnavailableError,
)
from servicekit.contract.prompt import check_text
from servicekit.contract.step import FinishReason
from servicekit.sampling_defaults import unset_filled
from servicekit.serving import cancel_and_wait

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20  # a 128k-token prompt as JSON token ids is ~1 MB
# Arrays and objects nested deeper are refused: what reads the body later (the chat template's
# kwargs go through transformers' recursive copy, then Jinja) recurses per level. OpenAI's bodies
# (a tool's JSON schema included) stay far below it.
MAX_JSON_DEPTH = 64


def check_request(request: Request, keys: KeyStore, *, open_route: bool = False) -> str:
    """The one place a request's headers are checked, before its body is read: the API key
    (``Authorization: Bearer``, or Anthropic's ``x-api-key``; the same keys as gRPC,
    UnauthenticatedError -> 401) unless the route is open, then a declared body over
    :data:`MAX_BODY_BYTES` is refused without reading it.
    Returns the caller's key digest ("" without keys): the owner of the requests it admits."""
    api_key = request.headers.get("x-api-key")  # Anthropic's clients send the key so
    authorization = request.headers.get("authorization") or (f"Bearer {api_key}" if api_key else None)
    owner = "" if open_route else keys.check(authorization)
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise InvalidArgumentError("body", f"larger than {MAX_BODY_BYTES} bytes")
    return owner


def _error(exc: PagedServeError) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body, status_code=status)


def _anthropic_error(exc: PagedServeError) -> JSONResponse:
    status, body = anthropic_error_body(exc)
    return JSONResponse(body, status_code=status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route: 404, a route's wrong method: 405) in OpenAI's error
    shape, like every other error here, so a client parses one shape."""
    kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "BadRequestError")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    if request.url.path.startswith("/v1/messages"):  # Anthropic's routes answer in its shape
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(anthropic_error_json(kind, message), status_code=exc.status_code, headers=exc.headers)
    return JSONResponse(error_json(exc.status_code, kind, message), status_code=exc.status_code, headers=exc.headers)


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def _json(request: Request) -> object:
    """The request's JSON body, read no further than ``MAX_BODY_BYTES`` (a declared length was
    checked by :func:`check_request`; a chunked body is refused once that many bytes arrived). A
    body declared as another media type (``curl -d`` sends a form's) is refused as vLLM does; an
    undeclared one is read as JSON."""
    declared = request.headers.get("content-type")
    if declared is not None:
        media = declared.split(";", 1)[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise InvalidArgumentError("content-type", f"must be application/json, got {declared[:100]!r}")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise InvalidArgumentError("body", f"larger than {MAX_BODY_BYTES} bytes")
        parts.append(part)
    body = b"".join(parts)
    try:
        value = json.loads(body)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise InvalidArgumentError("body", f"not valid JSON: {exc}") from None
    except RecursionError:  # nested past the interpreter's own limit ([[[[...]]]])
        raise _too_deep() from None
    _check_parsed(value)
    return value


def _too_deep() -> InvalidArgumentError:
    return InvalidArgumentError("body", f"arrays and objects nested deeper than {MAX_JSON_DEPTH} levels")


def _check_parsed(value: object) -> None:
    """Refuse what ``json.loads`` takes but nothing after it should see (without recursing):
    arrays and objects nested deeper than :data:`MAX_JSON_DEPTH`, and strings holding a lone
    surrogate (JSON's ``"\\ud800"`` escape: not text; the tokenizer and the wire cannot encode it)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            check_text("body", item)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        children = (*item.keys(), *item.values()) if isinstance(item, dict) else item
        pending.extend((child, depth + 1) for child in children if isinstance(child, (str, dict, list)))


async def _until_disconnect(request: Request, work: asyncio.Task):
    """``work``'s result, or ``work`` cancelled (so its requests are aborted) if the client goes first."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watcher = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise ClientGone("the client disconnected")  # nobody reads the answer
    return work.result()


async def sse_events(item, queue: asyncio.Queue, num_live: int, choices: list[ChoiceState], responder: Responder,
                     tasks: list[asyncio.Task]) -> AsyncIterator[bytes]:
    """The SSE stream of a call whose first queue item is ``item``, ``num_live`` choices still
    streaming (``OpenAIHttpApi._pump`` fills ``queue``; ``tasks`` are the pumps): one event per
    chunk of any choice, then the usage chunk (if asked), then ``[DONE]``. An error after the first
    event is an error event before ``[DONE]``. Starlette cancels this when the client disconnects;
    ``finally`` then cancels the pumps, which aborts their requests."""
    try:
        while True:
            index, payload = item
            if isinstance(payload, PagedServeError):
                yield _sse(error_body(payload)[1])
                break
            if payload is None:
                num_live -= 1
                if num_live == 0:
                    if responder.req.include_usage:
                        yield _sse(responder.usage_chunk(choices))
                    break
            else:
                event = _delta(choices[index], payload, responder)
                for one in [] if event is None else event if isinstance(event, list) else [event]:
                    yield _sse(one)
            item = await queue.get()
        yield _sse("[DONE]")
    finally:
        await cancel_and_wait(tasks)


def _prompt_only(chunk: GenerateChunk) -> GenerateChunk:
    """``chunk`` without what was generated (echo with max_tokens 0: the one token the engine ran
    is left out; the choice ends as "length" with no completion tokens)."""
    usage = chunk.usage
    return replace(chunk, text="", token_ids=[], logprobs=[], stop_string="", stop_token_id=None,
                   finish_reason=FinishReason.LENGTH if chunk.finish_reason is not None else None,
                   usage=replace(usage, completion_tokens=0) if usage is not None else None)


def _delta(choice: ChoiceState, chunk: GenerateChunk, responder: Responder) -> dict | list[dict] | None:
    # the text offset of this chunk's first token: the prefix (echo) and every earlier token's text,
    # whether or not the text was released yet (the whole answer's offsets, streamed)
    offset = len(choice.prefix) + choice.num_chars
    text, logprobs, _ids = choice.add(chunk)
    if responder.req.logprobs and not responder.chat:
        choice.num_chars += responder.token_chars(logprobs)
    with_prompt = bool(chunk.prompt_token_ids)
    if (not text and choice.finish_reason is None and choice.started and not (responder.req.logprobs and logprobs)
            and not with_prompt):
        return None  # token ids that end mid-character: their text comes with the next chunk
    return responder.delta(choice, text, logprobs, offset, with_prompt=with_prompt)


class OpenAIHttpApi:
    """The routes, over one :class:`GenerationService`; ``registry`` is what ``/metrics`` shows.
    ``max_choices`` (0: no limit): the most requests one call may ask for (prompts × n), so one call
    cannot make the gateway tokenize and admit without bound (``--max-requests-per-call``).
    ``responses``: the Responses API's routes (:class:`gateway_service.responses_api.ResponsesApi`)."""

    def __init__(self, service: GenerationService, registry: CollectorRegistry, *, keys: KeyStore | None = None,
                 guard_metrics: bool = False, max_choices: int = 0, responses=None) -> None:
        self._service = service
        self._max_choices = max_choices
        self._registry = registry
        self._keys = keys if keys is not None else KeyStore()
        self._token_text = TokenText(service.tokenizer.hf)
        self.app = Starlette(routes=[
            Route("/v1/completions", self._endpoint(self._completions), methods=["POST"]),
            Route("/v1/chat/completions", self._endpoint(self._chat), methods=["POST"]),
            Route("/v1/messages", self._endpoint(self._messages, errors=_anthropic_error), methods=["POST"]),
            Route("/v1/messages/count_tokens", self._endpoint(self._count_tokens, errors=_anthropic_error),
                  methods=["POST"]),
            Route("/v1/models", self._endpoint(self._models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._endpoint(self._model), methods=["GET"]),
            Route("/tokenize", self._endpoint(self._tokenize), methods=["POST"]),
            Route("/detokenize", self._endpoint(self._detokenize), methods=["POST"]),
            # readiness: 200 once a completion can be served (as vLLM's, whose clients start on it);
            # liveness: 200 while the process answers (draining, or no worker yet, included)
            Route("/health", self._endpoint(self._health, open_route=True), methods=["GET"]),
            Route("/livez", self._endpoint(self._live, open_route=True), methods=["GET"]),
            Route("/readyz", self._endpoint(self._health, open_route=True), methods=["GET"]),  # Kubernetes' name
            # vLLM's names for the readiness probe (``/ping``: SageMaker's) and its version route
            Route("/ping", self._endpoint(self._health, open_route=True), methods=["GET", "POST"]),
            Route("/version", self._endpoint(self._version, open_route=True), methods=["GET"]),
            Route("/metrics", self._endpoint(self._metrics, open_route=not guard_metrics), methods=["GET"]),
            # OpenAI's Responses API (gateway_service.responses_api)
            *(responses.routes(self._endpoint) if responses is not None else ()),
        ], exception_handlers={HTTPException: _http_error})

    def _endpoint(self, handler, *, open_route: bool = False, errors=_error):
        """``handler`` behind :func:`check_request`; ``errors`` shapes its errors (OpenAI's by default)."""
        async def endpoint(request: Request) -> Response:
            try:
                request.state.owner = check_request(request, self._keys, open_route=open_route)
                return await handler(request)
            except PagedServeError as exc:
                return errors(exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("unexpected error in %s", request.url.path)
                return errors(InternalError(f"internal error: {type(exc).__name__}"))
        return endpoint

    async def _served(self, model: str) -> ModelInfo:
        """The served model's limits; another name is a 404 (OpenAI's ``model_not_found``)."""
        if model:
            self._known(model)
        return await self._service.served_limits("")

    def _known(self, model: str) -> None:
        if model != self._service.model:
            raise NotFoundError(f"model {model!r} does not exist; this gateway serves {self._service.model!r}")

    # -- generation -----------------------------------------------------------------------------------

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion(await self._body(request)), chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat(await self._body(request)), chat=True)

    async def _body(self, request: Request) -> object:
        """The request's JSON, each sampling field it leaves unset (or null) given the served
        model's default (--sampling-defaults); a field it sends, even at OpenAI's default, stays."""
        body = await _json(request)
        return unset_filled(body, self._service.sampling_defaults) if isinstance(body, dict) else body

    async def _generate(self, request: Request, req: OpenAIRequest, *, chat: bool) -> Response:
        limits = await self._served(req.model)
        inputs = req.choice_inputs()
        if self._max_choices and len(inputs) > self._max_choices:  # refused before tokenizing any of them
            raise InvalidArgumentError("prompt" if len(req.inputs) > 1 else "n",
                                       f"{len(inputs)} requests (prompts x n); one call may ask for at most "
                                       f"{self._max_choices} (--max-requests-per-call)")
        if req.fill_max_tokens:  # tokenize once, and give the reply the room the prompt leaves
            ids = await self._service.prompt_ids(inputs[0], limits)
            inputs = [chat_max_tokens(inp, ids, limits.max_model_len) for inp in inputs]
        prefixes = [await self._echo_text(inp) if req.echo else "" for inp in inputs]
        call_id = ("chatcmpl-" if chat else "cmpl-") + (req.inputs[0].request_id or uuid.uuid4().hex)
        responder = Responder(req, chat=chat, call_id=call_id, model=self._service.model, token_text=self._token_text)
        choices = [ChoiceState(i, prefix=prefixes[i]) for i in range(len(inputs))]
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, inp, queue, request.state.owner, req))
                 for i, inp in enumerate(inputs)]
        try:
            # Whole or streamed, the first item decides the status: an input refused at admission
            # (400, 429, 503) is an HTTP error, not an event in a 200 stream.
            first = await _until_disconnect(request, asyncio.create_task(queue.get()))
            if isinstance(first[1], PagedServeError):
                return _error(first[1])
            if req.stream:
                events = sse_events(first, queue, len(tasks), choices, responder, tasks)
                tasks = []  # the stream owns them now
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            work = asyncio.create_task(self._collect(first, queue, len(tasks), choices))
            error = await _until_disconnect(request, work)
            return _error(error) if error is not None else JSONResponse(responder.whole(choices))
        finally:
            await cancel_and_wait(tasks)

    async def _echo_text(self, inp: GenerateInput) -> str:
        if inp.prompt is not None:
            return inp.prompt
        return await asyncio.to_thread(self._service.tokenizer.hf.decode, inp.prompt_token_ids)

    async def _pump(self, index: int, inp: GenerateInput, queue: asyncio.Queue, owner: str,
                    req: OpenAIRequest) -> None:
        """Choice ``index``'s chunks into ``queue`` as ``(index, chunk)``, then ``(index, None)``,
        or ``(index, error)`` (naming the field as the caller sent it). Cancelled, it closes
        ``generate``, which aborts the request."""
        try:
            async with aclosing(self._service.generate(inp, owner=owner)) as chunks:
                async for chunk in chunks:
                    queue.put_nowait((index, _prompt_only(chunk) if req.echo_only else chunk))
        except PagedServeError as exc:
            queue.put_nowait((index, req.as_sent(exc)))
            return
        except Exception as exc:
            log.exception("unexpected error generating choice %d", index)
            queue.put_nowait((index, InternalError(f"internal error: {type(exc).__name__}")))
            return
        queue.put_nowait((index, None))

    @staticmethod
    async def _collect(item, queue: asyncio.Queue, num_live: int, choices: list[ChoiceState]) -> PagedServeError | None:
        """Take every choice's chunks; the first error ends the call (returned)."""
        while True:
            index, payload = item
            if isinstance(payload, PagedServeError):
                return payload
            if payload is None:
                num_live -= 1
                if num_live == 0:
                    return None
            else:
                choices[index].add(payload)
            item = await queue.get()

    # -- Anthropic's Messages API (gateway_service.anthropic_messages) ---------------------------------

    async def _messages(self, request: Request) -> Response:
        """One message, whole or streamed, through the same pump as a chat choice."""
        req = parse_message(await _json(request), self._service.sampling_defaults)
        await self._served(req.model)
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(0, req.input, queue, request.state.owner, req))]
        try:
            first = await _until_disconnect(request, asyncio.create_task(queue.get()))
            if isinstance(first[1], PagedServeError):  # refused at admission: an HTTP error, not a 200 stream
                return _anthropic_error(first[1])
            if req.stream:
                events = message_events(first, queue, MessageEvents(req.message_id, self._service.model), tasks)
                tasks = []  # the stream owns them now
                return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            choice = ChoiceState(0)
            error = await _until_disconnect(request, asyncio.create_task(self._collect(first, queue, 1, [choice])))
            return _anthropic_error(error) if error is not None else JSONResponse(
                message_json(req.message_id, self._service.model, choice))
        finally:
            await cancel_and_wait(tasks)

    async def _count_tokens(self, request: Request) -> Response:
        """The prompt tokens of the chat a message with this body would send (as its usage counts them)."""
        model, inp = parse_count_tokens(await _json(request))
        limits = await self._served(model)
        return JSONResponse({"input_tokens": len(await self._service.prompt_ids(inp, limits))})

    # -- the rest -------------------------------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [await self._card()]})

    async def _model(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}``: the served model's card, another name a 404
        (``/v1/models/``, no name: the list)."""
        if not request.path_params["model"]:
            return await self._models(request)
        self._known(request.path_params["model"])
        return JSONResponse(await self._card())

    async def _card(self) -> dict:
        card = {"id": self._service.model, "object": "model", "created": 0, "owned_by": "pagedserve",
                "root": self._service.model, "parent": None,
                # what the sampling fields a request leaves unset take (--sampling-defaults)
                "sampling_defaults": dict(self._service.sampling_defaults)}
        try:
            card["max_model_len"] = (await self._service.served_limits("")).max_model_len
        except UnavailableError:
            pass  # no worker yet: the model is still the one served
        return card

    async def _tokenize(self, request: Request) -> Response:
        model, text, messages, options = parse_tokenize(await _json(request))
        limits = await self._served(model)
        ids = await self._service.tokenize(text, messages, limits, text_field="prompt", **options)
        return JSONResponse({"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids})

    async def _detokenize(self, request: Request) -> Response:
        model, ids = parse_detokenize(await _json(request))
        limits = await self._served(model)
        if any(t >= limits.vocab_size for t in ids):
            raise InvalidArgumentError("tokens", f"token ids must be < vocab_size ({limits.vocab_size})")
        text = await asyncio.to_thread(self._service.tokenizer.hf.decode, ids)
        return JSONResponse({"prompt": text})

    async def _health(self, request: Request) -> Response:
        """Ready: a completion sent now is served (not draining, a worker of the model registered
        and driven by a scheduler), or with ``--worker-wait-s`` waits for one; else 503 saying
        what is missing. The 200's body says whether a worker serves now."""
        ready, missing = await self._service.readiness()
        if not ready:
            raise UnavailableError(missing)
        return JSONResponse({"ready": True, "serving": not missing, "detail": missing or "a worker serves the model"})

    async def _live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _version(self, request: Request) -> Response:
        return JSONResponse({"version": version("pagedserve")})

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST)
