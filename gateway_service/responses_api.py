"""OpenAI's Responses API over HTTP: ``POST /v1/responses``, ``GET /v1/responses/{id}`` (whole, or
its events replayed and followed with ``stream=true&starting_after=N``), ``POST
/v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``.

A stored response lives in Redis (:mod:`gateway_service.response_store`), owned by the API key that
made it (another key gets 404), so every route works on every gateway: a follow-up's
``previous_response_id``, a retrieval, a cancel, a resumed stream. Its events are one log, written
by the one gateway that produces them (:mod:`gateway_service.response_runner`, holding the
response's lease) and read by every stream, which replays the log and then follows it through the
gateway's output fan-out (one XREAD loop, no connection per stream). A reader that finds an
unfinished response without a producer (its gateway died) takes the production over: it joins the
request as one more reader from output index 0 (the request runs on in the scheduler; its tokens
stay in Redis for ``--output-ttl-s``) and continues the log where it ended.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import replace

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway_service.admission import Admission
from gateway_service.generation import GenerationService
from gateway_service.http_api import _json, _until_disconnect
from gateway_service.messages import GenerateInput
from gateway_service.openai_params import OpenAIRequest, chat_max_tokens, parse_chat
from gateway_service.output_fanout import OutputFanout
from gateway_service.response_events import TERMINAL, ResponseBuilder, ResponseState, response_head
from gateway_service.response_runner import ResponseRun, is_terminal
from gateway_service.response_store import LEASE_MS, ResponseStore, StoredResponse
from gateway_service.responses_params import RESPONSE_ID_RE, as_sent, chat_body, new_response_id, parse_response
from servicekit.contract.errors import InvalidArgumentError, NotFoundError, PagedServeError, UnavailableError
from servicekit.sampling_defaults import unset_filled
from servicekit.serving import cancel_and_wait

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 10.0  # how long a cancel waits for the producer to end the response
MAX_LIST_LIMIT = 100


def _event(event: dict) -> bytes:
    """One server-sent event as OpenAI sends them: its type, then its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def _error_event(exc: PagedServeError, sequence_number: int) -> bytes:
    """A stream's end without its response's end (``sequence_number``: the last event sent, so a
    resume ``starting_after`` it misses nothing)."""
    return _event({"type": "error", "code": exc.code.lower(), "message": str(exc),
                   "param": getattr(exc, "field", None) or None, "sequence_number": sequence_number})


def _query_int(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidArgumentError(name, f"must be an integer, got {value[:40]!r}") from None


class ResponsesApi:
    """The routes, over the gateway's one :class:`GenerationService`; ``fanout`` follows event logs,
    ``admission`` aborts cancelled generations, ``gateway_id`` names this gateway's leases."""

    def __init__(self, service: GenerationService, store: ResponseStore, fanout: OutputFanout, admission: Admission,
                 gateway_id: str) -> None:
        self._service = service
        self._store = store
        self._fanout = fanout
        self._admission = admission
        self._gateway_id = gateway_id
        self._runs: set[ResponseRun] = set()

    def routes(self, endpoint) -> list[Route]:
        """The routes, each wrapped by ``endpoint`` (the HTTP API's key check and error shape)."""
        return [
            Route("/v1/responses", endpoint(self._create), methods=["POST"]),
            Route("/v1/responses/{response_id}", endpoint(self._retrieve), methods=["GET"]),
            Route("/v1/responses/{response_id}", endpoint(self._delete), methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", endpoint(self._cancel), methods=["POST"]),
            Route("/v1/responses/{response_id}/input_items", endpoint(self._input_items), methods=["GET"]),
        ]

    async def close(self) -> None:
        """Stop this gateway's producers; their responses are taken over by their next reader."""
        tasks = [run.task for run in self._runs if run.task is not None]
        for run in list(self._runs):
            run.stop(UnavailableError("the gateway is stopping; the response goes on on another gateway"))
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    # -- create ---------------------------------------------------------------------------------------

    async def _create(self, request: Request) -> Response:
        req = parse_response(await _json(request), new_response_id())
        owner = request.state.owner
        limits = await self._limits(req.model)
        history = await self._store_call(self._history(req.previous_response_id, owner))
        chat, sources = chat_body(req, history)
        chat = unset_filled(chat, getattr(self._service, "sampling_defaults", {}))
        try:
            parsed = parse_chat(chat)
        except InvalidArgumentError as exc:
            raise as_sent(exc, sources) from None
        request_id = "resp-" + req.response_id.removeprefix("resp_")
        try:
            inp = await self._input(parsed, limits, request_id, resume=False)
        except InvalidArgumentError as exc:
            raise as_sent(parsed.as_sent(exc), sources) from None
        head = response_head(req, model=self._service.model, temperature=chat.get("temperature", 1.0),
                             top_p=chat.get("top_p", 1.0))
        meta = StoredResponse(req.response_id, owner, request_id, chat, req.input_items,
                              history + req.input_items, head)
        run = ResponseRun(self._service, self._store, ResponseBuilder(ResponseState(head)), inp, owner=owner,
                          lease_token=self._lease_token() if req.store else None, meta=meta if req.store else None,
                          as_sent=lambda exc: as_sent(parsed.as_sent(exc), sources))
        events = run.listen() if req.stream else None
        task = self._start(run)
        try:
            await _until_disconnect(request, asyncio.ensure_future(asyncio.shield(run.started)))
            if req.stream:
                stream = self._local_stream(events, task, keep=req.background)
                task = None  # the stream owns it now
                return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            if req.background:
                task = None
                return JSONResponse(head)
            return JSONResponse(await _until_disconnect(request, asyncio.ensure_future(asyncio.shield(run.finished))))
        finally:
            if task is not None and not req.background:
                await cancel_and_wait([task])

    async def _limits(self, model: str):
        if model and model != self._service.model:
            raise NotFoundError(f"model {model!r} does not exist; this gateway serves {self._service.model!r}")
        return await self._service.served_limits("")

    async def _history(self, previous_id: str | None, owner: str) -> list[dict]:
        """The conversation ``previous_id`` continues: its own conversation, then its output."""
        if previous_id is None:
            return []
        try:
            previous = await self._store.load(previous_id, owner)
            obj = await self._store.object(previous_id)
        except NotFoundError as exc:
            raise NotFoundError(f"previous_response_id: {exc}") from None
        if obj["status"] not in TERMINAL:
            raise InvalidArgumentError("previous_response_id", f"response {previous_id!r} is still {obj['status']}; "
                                                               "continue it once it finished")
        return previous.conversation + obj["output"]

    async def _input(self, parsed: OpenAIRequest, limits, request_id: str, *, resume: bool) -> GenerateInput:
        """The generation's input (a resume of the stored one from output index 0 with ``resume``):
        as the chat API makes it, a reply without max_output_tokens getting what the model has room for."""
        inp = replace(parsed.inputs[0], request_id=request_id, resume_from_index=0 if resume else None)
        if parsed.fill_max_tokens:
            inp = chat_max_tokens(inp, await self._service.prompt_ids(inp, limits), limits.max_model_len)
        return inp

    def _lease_token(self) -> str:
        return f"{self._gateway_id}/{uuid.uuid4().hex[:12]}"

    def _start(self, run: ResponseRun) -> asyncio.Task:
        task = run.start()
        self._runs.add(run)
        task.add_done_callback(lambda _task: self._runs.discard(run))
        return task

    async def _local_stream(self, events: asyncio.Queue, task: asyncio.Task, *, keep: bool):
        """The events of a response this gateway produces, to the call that created it; the client
        gone, the generation is aborted unless the response is in the background."""
        last = -1
        try:
            while True:
                batch = await events.get()
                if isinstance(batch, BaseException):
                    if isinstance(batch, PagedServeError):
                        yield _error_event(batch, last)
                    return
                for event in batch:
                    last = event["sequence_number"]
                    yield _event(event)
                if is_terminal(batch[-1]):
                    return
        finally:
            if not keep:
                await cancel_and_wait([task])

    # -- read -----------------------------------------------------------------------------------------

    def _response_id(self, request: Request) -> str:
        response_id = request.path_params["response_id"]
        if not RESPONSE_ID_RE.fullmatch(response_id):
            raise NotFoundError(f"response {response_id[:80]!r} is unknown")
        return response_id

    @staticmethod
    async def _store_call(coro):
        """Await a store call; Redis away is UNAVAILABLE, as for every other call."""
        try:
            return await coro
        except RedisError as exc:
            raise UnavailableError(f"Redis is unreachable ({type(exc).__name__}); retry later") from exc

    async def _retrieve(self, request: Request) -> Response:
        response_id = self._response_id(request)
        if request.query_params.getlist("include"):
            raise InvalidArgumentError("include", "is not supported (nothing extra to include)")
        meta = await self._store_call(self._store.load(response_id, request.state.owner))
        stream = request.query_params.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise InvalidArgumentError("stream", "must be true or false")
        if stream == "true":
            after = _query_int(request, "starting_after", -1)
            return StreamingResponse(self._followed(meta, after), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await self._store_call(self._current(meta)))

    async def _current(self, meta: StoredResponse) -> dict:
        """The response as it stands: stored once finished, else rebuilt from its log (whose
        production is taken over here when nobody produces it)."""
        obj = await self._store.object(meta.response_id)
        if obj["status"] in TERMINAL:
            return obj
        await self._ensure_producer(meta)
        return ResponseState.replay(meta.head, await self._store.events(meta.response_id)).object()

    async def _followed(self, meta: StoredResponse, after: int):
        """The response's events after number ``after``: replayed from its log, then followed as they
        are written, until its terminal event (taking the production over when its producer died)."""
        response_id = meta.response_id
        sub = self._fanout.subscribe(self._store.events_key(response_id))
        try:
            await self._fanout.wake()
            await self._ensure_producer(meta)
            while True:
                try:
                    records = await asyncio.wait_for(sub.get(), LEASE_MS / 1000)
                except asyncio.TimeoutError:  # nothing new: is anybody producing it?
                    if not await self._store.exists(response_id):
                        yield _error_event(NotFoundError(f"response {response_id!r} was deleted"), after)
                        return
                    await self._ensure_producer(meta)
                    continue
                for data in records:
                    event = json.loads(data)
                    if event["sequence_number"] > after:
                        after = event["sequence_number"]
                        yield _event(event)
                    if is_terminal(event):  # (also one before starting_after: nothing follows it)
                        return
        except PagedServeError as exc:  # the fan-out's end (the gateway drains, Redis away too long)
            yield _error_event(exc, after)
        except RedisError as exc:
            yield _error_event(UnavailableError(f"Redis is unreachable ({type(exc).__name__})"), after)
        finally:
            self._fanout.unsubscribe(sub)

    async def _ensure_producer(self, meta: StoredResponse) -> None:
        """Take an unfinished response's production over when nobody holds its lease."""
        response_id = meta.response_id
        if (await self._store.object(response_id))["status"] in TERMINAL:
            return
        token = self._lease_token()
        if not await self._store.claim(response_id, token):
            return  # another reader took it first
        try:
            if (await self._store.object(response_id))["status"] in TERMINAL:
                await self._store.release(response_id, token)  # it ended just now
                return
            state = ResponseState.replay(meta.head, await self._store.events(response_id))
            limits = await self._service.served_limits("")
            inp = await self._input(parse_chat(meta.chat), limits, meta.request_id, resume=True)
        except BaseException:
            await self._store.release(response_id, token)
            raise
        log.info("response %s: no gateway produced it; taking it over after event %d", response_id,
                 state.next_seq - 1)
        self._start(ResponseRun(self._service, self._store, ResponseBuilder(state), inp, owner=meta.owner,
                                lease_token=token, meta=None, takeover=True))

    async def _input_items(self, request: Request) -> Response:
        response_id = self._response_id(request)
        if request.query_params.getlist("include"):
            raise InvalidArgumentError("include", "is not supported (nothing extra to include)")
        meta = await self._store_call(self._store.load(response_id, request.state.owner))
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidArgumentError("order", f"must be asc or desc, got {order[:20]!r}")
        limit = _query_int(request, "limit", 20)
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise InvalidArgumentError("limit", f"must be in [1, {MAX_LIST_LIMIT}], got {limit}")
        items = meta.input_items if order == "asc" else meta.input_items[::-1]
        start = 0
        after = request.query_params.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise InvalidArgumentError("after", f"is not an input item of {response_id}: {after[:80]!r}")
            start = ids.index(after) + 1
        page = items[start:start + limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)})

    # -- cancel and delete ----------------------------------------------------------------------------

    async def _cancel(self, request: Request) -> Response:
        """Cancel a background response: its generation is aborted and it ends ``cancelled`` (one
        that finished first stays as it ended)."""
        response_id = self._response_id(request)
        meta = await self._store_call(self._store.load(response_id, request.state.owner))
        return JSONResponse(await self._store_call(self._cancelled(meta)))

    async def _cancelled(self, meta: StoredResponse) -> dict:
        response_id = meta.response_id
        obj = await self._store.object(response_id)
        if not obj.get("background"):
            raise InvalidArgumentError("response_id", "only a background response can be cancelled")
        if obj["status"] in TERMINAL:
            return obj
        await self._store.request_cancel(response_id)
        await self._admission.abort(meta.request_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CANCEL_WAIT_S
        while loop.time() < deadline:
            obj = await self._store.object(response_id)
            if obj["status"] in TERMINAL:
                return obj
            token = self._lease_token()
            if await self._store.claim(response_id, token):  # nobody produces it: end it here
                obj = await self._store.object(response_id)
                if obj["status"] not in TERMINAL:  # (else it ended between the two reads)
                    state = ResponseState.replay(meta.head, await self._store.events(response_id))
                    events = ResponseBuilder(state).cancel()
                    if await self._store.append(response_id, token, events, state.object()) == 1:
                        return state.object()
                await self._store.release(response_id, token)
            await asyncio.sleep(0.05)
        return ResponseState.replay(meta.head, await self._store.events(response_id)).object()

    async def _delete(self, request: Request) -> Response:
        """Delete a response (an unfinished one's generation is aborted, its producer stops)."""
        response_id = self._response_id(request)
        meta = await self._store_call(self._store.load(response_id, request.state.owner))

        async def delete() -> None:
            if (await self._store.object(response_id))["status"] not in TERMINAL:
                await self._admission.abort(meta.request_id)
            await self._store.delete(response_id)
        await self._store_call(delete())
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
