"""A request's output records -> the chunks its reader is sent: detokenized incrementally, stop
strings applied, repeats after a failover dropped, records that come early held back until the
ones before them came, tokens below ``resume_from_index`` not sent again. The token that ends a
request as a stop token (EOS or a ``stop_token_ids`` entry) stays in the token ids but adds no text
unless ``include_stop_str`` (``OutputText``'s rule, as in vLLM).
Synchronous: the caller brings the records (waiting for them or handed them by the fanout).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterator

from gateway_service.messages import GenerateChunk
from gateway_service.text import OutputText
from servicekit.contract.api import Usage
from servicekit.contract.errors import error_for_code
from servicekit.contract.records import OutputRecord
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import FinishReason
from servicekit.proto.queue import output_record_from_bytes

log = logging.getLogger(__name__)


class ChunkAssembler:
    """``feed(records)`` -> the chunk they make (None when they add nothing to send); ``done`` once
    the last chunk (with ``finish_reason`` and ``usage``) was made. An error record raises its
    typed error. ``on_stop_string`` is called when a stop string ends the request (the scheduler
    does not know stop strings: it must be aborted)."""

    def __init__(self, request_id: str, tokenizer, prompt_ids: list[int], params: SamplingParams, *,
                 resume_from_index: int | None, skip_special_tokens: bool, include_stop_str: bool = False,
                 on_stop_string: Callable[[], None]) -> None:
        self._request_id = request_id
        self._text = OutputText(tokenizer, prompt_ids, params.stop, skip_special_tokens=skip_special_tokens,
                                include_stops=include_stop_str)
        self._start = resume_from_index or 0  # tokens below it were delivered before: not sent again
        self._next_index = 0  # every record token below it was seen (repeats after failover are dropped)
        # records that start past _next_index, a heap by (first index, arrival): see _in_order
        self._early: list[tuple[int, int, OutputRecord]] = []
        self._num_held = 0
        self._num_cached = 0
        self._num_prompt = len(prompt_ids)
        self._prompt_ids = prompt_ids
        self._wants_prompt_logprobs = params.prompt_logprobs is not None
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._on_stop_string = on_stop_string
        self.constrained = params.structured_output is not None
        self.done = False
        # the text of tokens below resume_from_index (which the client had): a tool-call reader
        # takes it (ToolCallReader.skip) so a resumed stream holds back what the first one did
        self.skipped_text = ""

    def feed(self, records: list[bytes]) -> GenerateChunk | None:
        chunk = GenerateChunk(request_id=self._request_id, first_index=max(self._next_index, self._start),
                              num_prompt_tokens=self._num_prompt)
        text: list[str] = []
        finish: FinishReason | None = None
        for record in self._in_order(records):
            if record.error_message:  # the scheduler refused or lost it, and says with which code
                raise error_for_code(record.error_code, f"request {self._request_id}: {record.error_message}",
                                     field=record.error_field)
            self._num_cached = max(self._num_cached, record.num_cached_tokens)
            if self._wants_prompt_logprobs and record.token_ids and self._next_index == 0 and self._start == 0:
                chunk.prompt_logprobs = record.prompt_logprobs  # with the first token, once
                chunk.prompt_token_ids = self._prompt_ids
            # a record that finishes as "stop" ends on its stop token (the scheduler knows no stop strings)
            stop_token = len(record.token_ids) - 1 if record.finish_reason is FinishReason.STOP else -1
            for j, token in enumerate(record.token_ids):
                index = record.first_index + j
                if index < self._next_index:
                    continue
                self._next_index = index + 1
                if j == stop_token:
                    chunk.stop_token_id = token if token in self._stop_token_ids else None
                piece, stop = self._text.add(token, ends_output=j == stop_token)
                if index >= self._start:
                    chunk.token_ids.append(token)
                    text.append(piece)
                    if record.logprobs:
                        chunk.logprobs.append(record.logprobs[j])
                else:
                    self.skipped_text += piece
                if stop is not None:
                    finish, chunk.stop_string, chunk.stop_token_id = FinishReason.STOP, stop, None
                    # Every reader sees the same stop; the request is aborted for all of them.
                    self._on_stop_string()
                    break
            if finish is None and record.finish_reason is not None:
                finish = record.finish_reason
                piece, stop = self._text.finish()
                text.append(piece)
                if stop is not None:
                    finish, chunk.stop_string = FinishReason.STOP, stop
            if finish is not None:
                break
        chunk.text = "".join(text)
        if finish is not None:
            chunk.finish_reason = finish
            chunk.usage = Usage(self._num_prompt, self._next_index, self._num_cached)
            self.done = True
            return chunk
        return chunk if chunk.token_ids or chunk.text else None

    @property
    def waiting(self) -> bool:
        """Whether records wait for the ones before them (see :meth:`_in_order`)."""
        return bool(self._early)

    def skip_gap(self) -> None:
        """Give up on the indices the waiting records lack: the next ``feed`` takes them as if
        those indices had come (a record Redis lost that no scheduler writes again). The
        caller's last resort, after waiting a while."""
        if self._early:
            first = self._early[0][0]
            log.warning("request %s: output indices %d..%d never came; continuing after them",
                        self._request_id, self._next_index, first - 1)
            self._next_index = first

    def _in_order(self, records: list[bytes]) -> Iterator[OutputRecord]:
        """The records by index: one whose tokens start past the next index expected waits here
        until the records before it came, then follows them. Within one scheduler records are
        published in order; across a takeover they may not arrive so: the old owner's retried
        publish of a later step (written to a Redis primary that then failed over, it was lost
        with the index before it) can reach the stream before the new owner, resuming from what
        Redis kept, writes that index again. Taking the later one at once would skip an index.
        A record without tokens (a finish or an abort on its own) is never held, nor one whose gap
        lies below ``resume_from_index`` (tokens this reader's client had)."""
        early = self._early
        if early:
            yield from self._ready()
        for data in records:
            record = output_record_from_bytes(data)
            first = record.first_index
            if record.token_ids and first > self._next_index and first > self._start and not record.error_message:
                self._num_held += 1
                heapq.heappush(early, (first, self._num_held, record))
                continue
            yield record  # the caller takes it in: _next_index moves on
            if early:  # almost never: no generator per record on the usual path
                yield from self._ready()

    def _ready(self) -> Iterator[OutputRecord]:
        """The waiting records whose turn came, in index order."""
        early = self._early
        while early and early[0][0] <= self._next_index:
            yield heapq.heappop(early)[2]

    @property
    def num_tokens(self) -> int:
        """Output tokens seen so far."""
        return self._next_index
