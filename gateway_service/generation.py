"""One Generate call at the gateway: validate, tokenize, admit to Redis, then stream the request's
output records back as text — detokenized incrementally, stop strings applied — until it finishes.

The gateway holds no request state beyond the life of the call: everything needed to resume a
stream lives in Redis (the output stream, whose records carry their output indices, and whose first
entry keeps digests of the admitted input, which a resume must match).

Readers: the admitting call and every resume of the request are its readers (counted in Redis,
across gateways). A reader that leaves before the request finished (cancelled, deadline) aborts it
only when it is the last one, so a resumer that gives up never cuts off the owner, nor the owner a
resumer that took over its stream.

Tokenizing runs in a thread, never on the event loop, and text longer than the model could take
is refused by its size before it is tokenized (``prompt_bytes_per_token``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from redis.exceptions import RedisError, ResponseError

from gateway_service.chunks import ChunkAssembler
from gateway_service.messages import GenerateChunk, GenerateInput
from gateway_service.metrics import GatewayMetrics
from gateway_service.model_limits import ModelLimitsView
from gateway_service.output_fanout import OutputFanout, SlowReaderError, Subscription
from gateway_service.admission import Admission, request_digests
from gateway_service.text import PromptTokenizer
from gateway_service.tool_calls import DEFAULT_PARSER, ToolCallReader
from servicekit.auth import ConcurrencyLimits, TokenRateLimits
from servicekit.contract.api import ModelInfo
from servicekit.contract.errors import InvalidArgumentError, PagedServeError, UnavailableError
from servicekit.contract.prompt import check_allowed_token_ids, check_prompt, truncate_prompt
from servicekit.contract.structured_output import StructuredOutput
from servicekit.grammar import CHECK_TIMEOUT_S, MAX_SPEC_BYTES, check_sampling
from servicekit.contract.records import RequestRecord
from servicekit.contract.step import FinishReason
from servicekit.proto.queue import request_record_to_bytes
from servicekit.redis_layout import RedisKeys

log = logging.getLogger(__name__)

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# What a chat template may add to the turns' text (markers per turn; its own text and variables)
TEMPLATE_BYTES_PER_TURN = 512
TEMPLATE_BYTES = 128 << 10


# Plain text up to this many characters (about 2.5 ms of tokenizing) is tokenized on the event loop: a
# 346-token prompt takes 0.43 ms, about what a hand-off to the thread pool and back costs, and a
# burst's prompts no longer wait in that pool's queue. Longer text goes to a thread, so one huge
# prompt never stalls the other calls.
INLINE_TOKENIZE_CHARS = 8192


def rendered_chat_limit(text_bytes: int, num_turns: int) -> int:
    """The most bytes a chat's rendered text may have, before it is tokenized: the text the model
    takes (``text_bytes``; the turns' own bytes are checked against it first), the template's markers
    per turn and its own text and variables — not a template variable repeated per turn."""
    return text_bytes + num_turns * TEMPLATE_BYTES_PER_TURN + TEMPLATE_BYTES


# How long output records that came before the ones they follow wait for them (ChunkAssembler:
# the catch-up of a request's new scheduler after a Redis failover fills such a gap within steps);
# then the reader goes on without the missing indices rather than hang.
GAP_WAIT_S = 10.0


class _Reading:
    """One call's reading of an admitted request: its subscription, its chunk assembler, and the
    accounting of what it was sent (tokens charged to the key, metrics, whether it finished)."""

    __slots__ = ("assembler", "finished", "gap_timer", "owner", "request_id", "sub", "timer", "tools",
                 "_gap_at", "_tokens_per_key")

    def __init__(self, request_id: str, sub: Subscription, assembler: ChunkAssembler, owner: str,
                 tokens_per_key: TokenRateLimits, timer, tools: ToolCallReader | None = None) -> None:
        self.request_id = request_id
        self.sub = sub
        self.assembler = assembler
        self.tools = tools
        self.owner = owner
        self._tokens_per_key = tokens_per_key
        self.timer = timer
        self.finished = False  # its last chunk was made, or its stream ended with an error of its own
        self.gap_timer: asyncio.TimerHandle | None = None  # while records wait for earlier ones
        self._gap_at = 0  # the tokens taken in when the timer was set

    async def next_records(self) -> list[bytes]:
        try:
            return await self.sub.get()
        except PagedServeError:
            # Redis away (the request lives on; the client resumes it by id), the request's own final
            # error record, or a slow reader's end (aborted already): nothing to abort either way.
            self.finished = True
            raise

    def take(self, records: list[bytes]) -> GenerateChunk | None:
        """The chunk ``records`` make, accounted for (None: nothing to send yet)."""
        try:
            chunk = self.assembler.feed(records)
        except PagedServeError:
            self.finished = True
            raise
        waiting = self.assembler.waiting
        if self.gap_timer is not None and (not waiting or self._gap_at != self.assembler.num_tokens):
            self.close()  # the gap was filled (or moved on: a later one gets its own wait)
        if waiting and self.gap_timer is None:
            self._gap_at = self.assembler.num_tokens
            self.gap_timer = asyncio.get_running_loop().call_later(GAP_WAIT_S, self._skip_gap)
        if chunk is None:
            return None
        if self.tools is not None:
            self._read_tools(chunk)
        self._tokens_per_key.charge(self.owner, len(chunk.token_ids))
        if chunk.finish_reason is not None:
            self.finished = True
            log.info("request %s finished (%s): %d tokens", self.request_id, chunk.finish_reason,
                     self.assembler.num_tokens)
            if chunk.finish_reason is FinishReason.LENGTH and self.assembler.constrained:
                log.warning("request %s: its structured output's grammar could not end within max_tokens (%d "
                            "tokens); the output is incomplete (finish_reason length)", self.request_id,
                            self.assembler.num_tokens)
        if self.timer is not None:
            self.timer.chunk(chunk)
        return chunk

    def _skip_gap(self) -> None:
        """GAP_WAIT_S passed with records waiting: take them without the indices they lack (an
        empty delivery wakes the reader, whichever way it reads)."""
        self.gap_timer = None
        self.assembler.skip_gap()
        self.sub.deliver([])

    def close(self) -> None:
        if self.gap_timer is not None:
            self.gap_timer.cancel()
            self.gap_timer = None

    def _read_tools(self, chunk: GenerateChunk) -> None:
        """``chunk``'s text as content only; its calls on the last one (finish_reason stays STOP)."""
        if self.assembler.skipped_text:  # a resumed stream: what its client had, read first
            self.tools.skip(self.assembler.skipped_text)
            self.assembler.skipped_text = ""
        if chunk.finish_reason is None:
            chunk.text = self.tools.read(chunk.text)
        else:
            chunk.text, chunk.tool_calls = self.tools.finish(chunk.text, stopped=chunk.finish_reason is FinishReason.STOP)


class GenerationService:
    """The gateway's logic, free of gRPC. ``in_flight`` counts live Generate streams.
    ``sampling_defaults``: what the sampling fields a request leaves unset take (field name ->
    value, ``servicekit.sampling_defaults``); each API fills them in before it parses a request,
    since only it knows which fields were sent. ``tenant_of(owner, user)``: the tenant a request
    counts against in fair shares and its weight (0: not given), from its API key's digest and its
    end-user field (default: the digest, else the user)."""

    def __init__(self, *, model: str, keys: RedisKeys, tokenizer: PromptTokenizer, limits: ModelLimitsView,
                 admission: Admission, fanout: OutputFanout, seed_rng: random.Random | None = None,
                 prompt_bytes_per_token: int = 16, per_key: ConcurrencyLimits | None = None,
                 tokens_per_key: TokenRateLimits | None = None, max_buffered_outputs: int = 0,
                 metrics: GatewayMetrics | None = None,
                 structured_output_limits: tuple[int, float] = (MAX_SPEC_BYTES, CHECK_TIMEOUT_S),
                 tool_parser: str = DEFAULT_PARSER, sampling_defaults: dict[str, float] | None = None,
                 worker_wait_s: float = 0.0,
                 tenant_of: Callable[[str, str], tuple[str, float]] | None = None) -> None:
        self.sampling_defaults = dict(sampling_defaults or {})
        self._tenant_of = tenant_of or (lambda owner, user: (owner or user, 0.0))
        self._worker_wait_s = worker_wait_s
        self._structured_limits = structured_output_limits
        self._tool_parser = tool_parser
        self._tokens_per_key = tokens_per_key or TokenRateLimits(0)
        self._max_buffered = max_buffered_outputs
        self.model = model
        self._per_key = per_key or ConcurrencyLimits(0)
        self._metrics = metrics
        self._prompt_bytes_per_token = prompt_bytes_per_token
        self._keys = keys
        self.tokenizer = tokenizer
        self._limits = limits
        self._admission = admission
        self._fanout = fanout
        self._rng = seed_rng if seed_rng is not None else random.SystemRandom()
        self._background: set[asyncio.Task] = set()
        self._draining = asyncio.Event()
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def draining(self) -> bool:
        """Set when the gateway drains: new generations are refused (UNAVAILABLE)."""
        return self._draining.is_set()

    @draining.setter
    def draining(self, value: bool) -> None:
        if value:
            self._draining.set()
        else:
            self._draining.clear()

    async def wait_draining(self) -> None:
        await self._draining.wait()

    # -- shared checks --------------------------------------------------------------------------------

    async def served_limits(self, model: str) -> ModelInfo:
        """The limits of the served model; ``model`` must be empty or its name."""
        if model and model != self.model:
            raise InvalidArgumentError("model", f"unknown model {model!r}; this gateway serves {self.model!r}")
        limits = await self._limits.get()
        if limits is None or (not limits.num_workers and not self._worker_wait_s):
            raise UnavailableError(f"no worker serving {self.model!r} is registered")
        return limits

    async def model_info(self) -> ModelInfo:
        """The served model's limits and the sampling defaults its requests get."""
        limits = await self.served_limits("")
        return dataclasses.replace(limits, sampling_defaults=tuple(sorted(self.sampling_defaults.items())))

    async def not_ready(self) -> str | None:
        """Why a generation sent now would not be served yet (draining, no worker registered or
        driven); None when it would."""
        if self.draining:
            return "the gateway is draining"
        return await self._limits.not_ready()

    async def readiness(self) -> tuple[bool, str]:
        """(ready, what is missing): ready when a request sent now is admitted and served — at
        once (nothing missing), or, with ``--worker-wait-s``, once a worker comes (scale from zero:
        the model's limits are known, the request waits in the queue)."""
        reason = await self.not_ready()
        if reason is None:
            return True, ""
        if not self.draining and self._worker_wait_s and self._limits.current is not None:
            return True, f"{reason}; requests wait up to {self._worker_wait_s:g} s for one (--worker-wait-s)"
        return False, reason

    async def tokenize(self, text: str | None, messages: list[dict[str, str]] | None, limits: ModelInfo,
                       *, text_field: str = "text", add_special_tokens: bool = True,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       chat_template_kwargs: dict | None = None) -> list[int]:
        """The token ids of ``text`` (with the model's special tokens unless ``add_special_tokens``
        is off) or ``messages`` (through the chat template, with its generation prompt unless
        ``add_generation_prompt`` is off, or ending inside the last turn with
        ``continue_final_message``; ``chat_template_kwargs``: extra template variables), computed in
        a thread (short text in place: :data:`INLINE_TOKENIZE_CHARS`). Text the model could not take whole
        is refused by its size first: a token covers at most ``prompt_bytes_per_token`` bytes, so
        more than ``max_model_len`` times that many bytes is more than ``max_model_len`` tokens."""
        if messages is not None:
            self._check_size(sum(len(m["role"].encode()) + len(m["content"].encode()) for m in messages),
                             limits, "messages")
            return await asyncio.to_thread(self.tokenizer.encode_chat, messages,
                                           check_size=lambda n: self._check_rendered(n, limits, len(messages)),
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message,
                                           template_kwargs=chat_template_kwargs)
        text = text or ""
        self._check_size(len(text.encode()), limits, text_field)
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode_text(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode_text, text, add_special_tokens=add_special_tokens)

    def _check_size(self, num_bytes: int, limits: ModelInfo, field: str) -> None:
        max_bytes = limits.max_model_len * self._prompt_bytes_per_token
        if num_bytes > max_bytes:
            raise InvalidArgumentError(
                field, f"This model's maximum context length is {limits.max_model_len} tokens, which is at most "
                       f"{max_bytes} bytes of text ({self._prompt_bytes_per_token} bytes per token, "
                       f"--prompt-bytes-per-token); got {num_bytes} bytes")

    def _check_rendered(self, num_bytes: int, limits: ModelInfo, num_turns: int) -> None:
        max_bytes = rendered_chat_limit(limits.max_model_len * self._prompt_bytes_per_token, num_turns)
        if num_bytes > max_bytes:
            raise InvalidArgumentError(
                "messages", f"the chat template rendered {num_bytes} bytes; at most {max_bytes} (the model's length "
                            f"in bytes, {TEMPLATE_BYTES_PER_TURN} a turn and {TEMPLATE_BYTES} for the template's own "
                            "text and variables)")

    async def prompt_ids(self, inp: GenerateInput, limits: ModelInfo) -> list[int]:
        """The token ids ``inp`` asks to continue: given, or its text or chat tokenized (the chat
        template's switches applied), then truncated as asked; not checked yet."""
        if inp.prompt_token_ids is not None:
            ids = inp.prompt_token_ids
        elif inp.messages is not None:
            ids = await self.tokenize(None, inp.messages, limits, add_generation_prompt=inp.add_generation_prompt,
                                      continue_final_message=inp.continue_final_message,
                                      chat_template_kwargs=inp.chat_template_kwargs)
        else:
            if not inp.prompt:
                raise InvalidArgumentError("prompt", "must not be empty")
            ids = await self.tokenize(inp.prompt, None, limits, text_field="prompt",
                                      add_special_tokens=inp.add_special_tokens)
        return truncate_prompt(ids, inp.truncate_prompt_tokens, limits.max_model_len)

    async def _prompt_token_ids(self, inp: GenerateInput, limits: ModelInfo) -> list[int]:
        ids = await self.prompt_ids(inp, limits)
        field = "prompt_token_ids" if inp.prompt_token_ids is not None else "prompt"
        check_prompt(ids, inp.sampling_params.max_tokens, max_model_len=limits.max_model_len,
                     vocab_size=limits.vocab_size, field=field, logit_bias=inp.sampling_params.logit_bias,
                     allowed_token_ids=inp.sampling_params.allowed_token_ids,
                     stop_token_ids=inp.sampling_params.stop_token_ids)
        check_allowed_token_ids(inp.sampling_params, limits.eos_token_ids)
        await self._check_structured_output(inp.sampling_params.structured_output)
        return ids

    async def _check_structured_output(self, constraint: StructuredOutput | None) -> None:
        """A constraint the grammar engine accepts, within its bounds, before anything is queued."""
        if constraint is None:
            return
        max_bytes, timeout_s = self._structured_limits
        try:
            await asyncio.wait_for(asyncio.to_thread(check_sampling, constraint, max_bytes=max_bytes), timeout_s)
        except TimeoutError:
            raise InvalidArgumentError("structured_output", f"took longer than {timeout_s:g} s to check; simplify it "
                                                            "(the gateway's --structured-output-check-s)") from None

    # -- Generate -------------------------------------------------------------------------------------

    async def generate(self, inp: GenerateInput, *, timeout_s: float | None = None, owner: str = "",
                       on_admitted: Callable[[], None] | None = None) -> AsyncIterator[GenerateChunk]:
        """Admit the request (or, resuming, join it as one more reader after checking the input
        matches) and yield its chunks; the last has ``finish_reason`` and ``usage``. Closing the
        iterator early (client gone, deadline) aborts the request when no other call reads it.
        ``owner``: the digest of the caller's API key; the request belongs to it, and only the
        same key may resume it (``""``: no keys configured). ``on_admitted`` is called once the
        request is admitted (or joined), before its first chunk: every refusal came before it."""
        async with self._reading(inp, timeout_s, owner, on_admitted) as reading:
            while not reading.assembler.done:
                chunk = reading.take(await reading.next_records())
                if chunk is not None:
                    yield chunk

    async def generate_to(self, inp: GenerateInput, emit: Callable[[GenerateChunk], None], *,
                          timeout_s: float | None = None, owner: str = "") -> None:
        """:meth:`generate`, with each chunk handed to ``emit`` as its records arrive, inside the
        output fanout's task: no task of this request wakes per chunk (GenerateMany's way, many
        requests to one call). Returns after the last chunk; cancelling it is closing a
        :meth:`generate` early. ``emit`` may raise :class:`SlowReaderError` (its client is too far
        behind): the request is then aborted and this raises it."""
        async with self._reading(inp, timeout_s, owner) as reading:
            done = asyncio.get_running_loop().create_future()

            def on_delivery(item: list[bytes] | BaseException) -> None:
                if done.done():
                    return
                try:
                    if isinstance(item, BaseException):
                        raise item
                    chunk = reading.take(item)
                    if chunk is not None:
                        emit(chunk)
                    if reading.assembler.done:
                        done.set_result(None)
                except PagedServeError as exc:  # see next_records: nothing to abort, but a slow reader
                    if isinstance(exc, SlowReaderError):  # (emit's refusal) whose request runs on
                        self._on_slow_reader(reading.request_id)
                    reading.finished = True
                    done.set_exception(exc)
                except Exception as exc:  # noqa: BLE001 - never into the fanout's loop
                    done.set_exception(exc)

            reading.sub.listen(on_delivery)
            await done

    @asynccontextmanager
    async def _reading(self, inp: GenerateInput, timeout_s: float | None, owner: str,
                       on_admitted: Callable[[], None] | None = None):
        """Admit (or join) the request, yield its :class:`_Reading`, and on the way out leave it:
        aborting it when it did not finish and no other call reads it."""
        if self.draining:
            raise UnavailableError("the gateway is draining; use another replica")
        deadline = time.time() + timeout_s if timeout_s else 0.0  # from the call's start, tokenizing included
        limits = await self.served_limits(inp.model)
        if inp.request_id and not REQUEST_ID_RE.fullmatch(inp.request_id):
            raise InvalidArgumentError("request_id", "at most 128 characters from [A-Za-z0-9._:-]")
        if inp.resume_from_index is not None and not inp.request_id:
            raise InvalidArgumentError("request_id", "required when resume_from_index is set")
        prompt_ids = await self._prompt_token_ids(inp, limits)
        params = inp.sampling_params
        digests = request_digests(prompt_ids, params)  # as given: a resume repeats the unseeded params
        params = params.seeded(self._rng)  # decision 6: a seed at admission makes every replay identical
        request_id = inp.request_id or uuid.uuid4().hex  # 122 random bits: not guessable
        self._tokens_per_key.check(owner)
        self._per_key.acquire(owner)
        self._enter()
        # A client that stops reading fills this call's buffer: the request is aborted at once (as
        # for a client gone); the call ends with RESOURCE_EXHAUSTED when, or if, its client reads on.
        # The admitting call reads the request's records from the gateway's live stream (one read a
        # step for all its requests); a resume reads the request's own stream, from its start.
        sub = self._fanout.subscribe(self._keys.output(request_id), max_pending=self._max_buffered,
                                     on_overflow=lambda: self._on_slow_reader(request_id),
                                     live=inp.resume_from_index is None)
        admitted = False  # counted among the request's readers in Redis
        reading = None
        watch = None
        try:
            try:
                if inp.resume_from_index is not None:
                    await self._landed(request_id, self._admission.join(request_id, digests, self._fanout.wake_key, owner))
                else:
                    tenant, tenant_weight = self._tenant_of(owner, inp.user)
                    record = request_record_to_bytes(RequestRecord(
                        request_id, prompt_ids, params, arrival_time=time.time(), deadline=deadline,
                        priority=inp.priority, cache_salt=inp.cache_salt, tenant=tenant,
                        tenant_weight=tenant_weight))
                    sent = time.perf_counter()
                    await self._landed(request_id, self._admission.admit(request_id, record, digests,
                                                                     self._fanout.wake_key, owner,
                                                                     self._fanout.live_key))
                    if self._metrics is not None:
                        self._metrics.redis_admit.observe(time.perf_counter() - sent)
            except ResponseError as exc:  # Redis answered, and refused (out of memory, read-only replica)
                raise UnavailableError(f"Redis refused the admission ({exc}); retry later") from exc
            except RedisError as exc:
                raise UnavailableError(f"Redis is unreachable ({type(exc).__name__}); retry later") from exc
            admitted = True
            if inp.resume_from_index is None:
                self._tokens_per_key.charge(owner, len(prompt_ids))
                log.info("request %s admitted: %d prompt tokens, max_tokens %d, temperature %g, top_k %d, top_p %g, "
                         "min_p %g", request_id, len(prompt_ids), params.max_tokens, params.temperature, params.top_k,
                         params.top_p, params.min_p)
            else:
                log.info("request %s resumed from output index %d", request_id, inp.resume_from_index)
            log.debug("request %s prompt: %r", request_id, inp.prompt)
            assembler = ChunkAssembler(
                request_id, self.tokenizer.hf, prompt_ids, params, resume_from_index=inp.resume_from_index,
                skip_special_tokens=not inp.include_special_tokens, include_stop_str=inp.include_stop_str,
                on_stop_string=lambda: self._in_background(self._abort(request_id)))
            reading = _Reading(request_id, sub, assembler, owner, self._tokens_per_key,
                               self._metrics.start() if self._metrics is not None else None,
                               None if inp.tools is None else ToolCallReader(inp.tools, request_id, self._tool_parser))
            if not limits.num_workers and inp.resume_from_index is None:  # scale from zero: wait for one
                watch = asyncio.create_task(self._await_worker(request_id, sub, deadline))
            if on_admitted is not None:
                on_admitted()
            yield reading
        finally:
            if watch is not None:
                watch.cancel()
            if reading is not None:
                reading.close()
            self._fanout.unsubscribe(sub)
            if admitted:
                finished = reading is not None and reading.finished
                if not finished:
                    log.info("request %s left by a client: aborting it unless another call reads it", request_id)
                    if reading is not None and reading.timer is not None:
                        reading.timer.client_left()
                self._in_background(self._leave(request_id, abort=not finished))
            self._exit()
            self._per_key.release(owner)

    async def _await_worker(self, request_id: str, sub: Subscription, deadline: float) -> None:
        """A request admitted while no worker of the model was registered waits in the queue for
        one up to ``--worker-wait-s`` (its deadline if sooner); none came: it is aborted and its
        call ends UNAVAILABLE. One that came takes it from the queue as any other."""
        end = time.time() + self._worker_wait_s
        if deadline:
            end = min(end, deadline)
        while time.time() < end:
            await asyncio.sleep(min(self._limits.refresh_s, max(0.0, end - time.time())))
            if self._limits.num_workers:
                return
        log.warning("request %s: no worker of %r came within %.0f s of its admission; aborting it", request_id,
                    self.model, self._worker_wait_s)
        await self._abort(request_id)
        sub.fail(UnavailableError(f"no worker serving {self.model!r} came within {self._worker_wait_s:g} s "
                                  "(--worker-wait-s); the request was withdrawn from the queue"))

    async def _landed(self, request_id: str, admission) -> None:
        """Await ``admission`` (an admit or a join in Redis). Cancelled meanwhile — the call's deadline
        passed, its client left — the admission still runs to its end: if it lands, this call leaves
        the request as a reader who did not finish it (so it is aborted unless another call reads
        it), else the request would run to max_tokens with nobody reading (seen under load with
        0.3 s deadlines: five such requests generated 400 tokens each)."""
        task = asyncio.ensure_future(admission)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            def landed(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None:
                    self._in_background(self._leave(request_id, abort=True))
            task.add_done_callback(landed)
            raise

    # -- aborts and draining --------------------------------------------------------------------------

    def _in_background(self, coro) -> None:
        """Run a Redis write without waiting for it (the caller may be a cancelled task)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, request_id: str) -> None:
        try:
            await self._admission.abort(request_id)
        except Exception as exc:  # Redis away: the scheduler finishes it at max_tokens anyway
            log.warning("could not publish abort of %s: %s", request_id, exc)

    def _on_slow_reader(self, request_id: str) -> None:
        log.info("request %s: its client stopped reading (%d output records waiting); aborting it", request_id,
                 self._max_buffered)
        self._in_background(self._abort(request_id))

    async def _leave(self, request_id: str, *, abort: bool) -> None:
        try:
            await self._admission.leave(request_id, abort=abort)
        except Exception as exc:  # Redis away: counted as a reader still, the request runs to its end
            log.warning("could not leave request %s: %s", request_id, exc)

    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Returns when no Generate stream is live (used while draining)."""
        await self._idle.wait()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
