"""A request's output records -> the chunks its reader is sent: detokenized incrementally, stop
strings applied, repeats after a failover dropped, tokens below ``resume_from_index`` not sent
again. The token that ends a request as a stop token (EOS or a ``stop_token_ids`` entry) stays in
the token ids but adds no text unless ``include_stop_str`` (``OutputText``'s rule, as in vLLM).
Synchronous: the caller brings the records (waiting for them or handed them by the fanout).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway_service.messages import GenerateChunk
from gateway_service.text import OutputText
from servicekit.contract.api import Usage
from servicekit.contract.errors import error_for_code
from servicekit.contract.sampling_params import SamplingParams
from servicekit.contract.step import FinishReason
from servicekit.proto.queue import output_record_from_bytes


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
        for data in records:
            record = output_record_from_bytes(data)
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
    def num_tokens(self) -> int:
        """Output tokens seen so far."""
        return self._next_index
