"""The gateway's generation chunks → OpenAI response objects (completions and chat, whole and
streamed), usage and logprobs, and OpenAI's error shape.

One :class:`ChoiceState` per choice accumulates what a non-streamed answer needs and shapes each
streamed delta, so the streamed text and the whole text are built by the same code and a stream's
deltas concatenate to exactly the non-streamed text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway_service.messages import GenerateChunk
from gateway_service.openai_params import OpenAIRequest
from gateway_service.tool_calls import ToolCall
from servicekit.contract.api import Usage
from servicekit.contract.errors import PagedServeError
from servicekit.contract.step import TokenLogprobs

# Typed error code (gRPC status name) → (HTTP status, OpenAI error type).
HTTP_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "BadRequestError"),
    "NOT_FOUND": (404, "NotFoundError"),
    "ALREADY_EXISTS": (409, "ConflictError"),
    "RESOURCE_EXHAUSTED": (429, "RateLimitError"),
    "UNAUTHENTICATED": (401, "AuthenticationError"),
    "UNAVAILABLE": (503, "ServiceUnavailableError"),
    "DEADLINE_EXCEEDED": (504, "TimeoutError"),
    "CANCELLED": (499, "CancelledError"),
    "FAILED_PRECONDITION": (400, "BadRequestError"),
    "ABORTED": (500, "InternalServerError"),
    "INTERNAL": (500, "InternalServerError"),
}


def error_json(status: int, kind: str, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_body(exc: PagedServeError) -> tuple[int, dict]:
    """(HTTP status, OpenAI's error shape) of a typed error."""
    status, kind = HTTP_STATUS.get(exc.code, (500, "InternalServerError"))
    return status, error_json(status, kind, str(exc), getattr(exc, "field", None) or None)


def usage_json(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def total_usage(usages: list[Usage | None], n: int) -> Usage:
    """One call's usage: completion tokens of every choice; prompt (and cached) tokens once per
    prompt, from its first sample (the other samples repeat the same prompt)."""
    done = [u or Usage(0, 0, 0) for u in usages]
    firsts = done[::n]
    return Usage(sum(u.prompt_tokens for u in firsts), sum(u.completion_tokens for u in done),
                 sum(u.cached_prompt_tokens for u in firsts))


class TokenText:
    """Token id → its text, as logprobs show it: the token as it reads inside a text, after another
    token. Decoded alone, a SentencePiece token (Llama 2, Mistral) loses its leading space ("▁the"
    gives "the"), so logprob tokens would not join to the output's text; decoded after an anchor
    token ("a") and cut after the anchor's text, it keeps it (" the"). Byte-level BPE (GPT-2, Llama 3,
    SmolLM) decodes the same both ways. Remembered per id (the vocabulary bounds what is kept)."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._hf = hf_tokenizer
        self._texts: dict[int, str] = {}
        self._anchor: list[int] = list(hf_tokenizer.encode("a", add_special_tokens=False))[:1]
        self._anchor_text = hf_tokenizer.decode(self._anchor) if self._anchor else ""

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode(token_id)
        return text

    def _decode(self, token_id: int) -> str:
        if self._anchor_text:
            both = self._hf.decode(self._anchor + [token_id])
            if both.startswith(self._anchor_text):
                return both[len(self._anchor_text):]
        return self._hf.decode([token_id])


def token_id_text(token_id: int) -> str:
    """A token as vLLM's ``return_tokens_as_token_ids`` names it in logprobs: ``token_id:<id>``
    (unambiguous where a token alone does not decode to text, e.g. part of a UTF-8 character)."""
    return f"token_id:{token_id}"


@dataclass(slots=True)
class ChoiceState:
    """One choice of a call: what arrived so far. ``prefix`` (echo) is sent before anything else."""

    index: int
    prefix: str = ""
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    started: bool = False  # a streamed chat choice sends role "assistant" in its first delta
    # characters of the text of the tokens taken so far (completions' logprobs text_offset counts
    # in the tokens' text, which a held-back stop string or character may not have released yet)
    num_chars: int = 0
    num_prompt_tokens: int = 0
    # arrived with the first token when prompt logprobs were asked for (echo with logprobs, or
    # vLLM's prompt_logprobs): one per prompt token after the first, and the prompt's ids
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)  # a chat with tools: the calls, on finishing

    def add(self, chunk: GenerateChunk) -> tuple[str, list[TokenLogprobs], list[int]]:
        """Take one chunk; returns its (text, logprobs, token ids) as the client sees them."""
        text = chunk.text
        self.num_prompt_tokens = chunk.num_prompt_tokens or self.num_prompt_tokens
        if chunk.prompt_token_ids:
            self.prompt_token_ids = chunk.prompt_token_ids
            # all of them or none (a worker that computes none, as the simulated one)
            if len(chunk.prompt_logprobs) == len(chunk.prompt_token_ids) - 1:
                self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason is not None:
            self.finish_reason = "tool_calls" if chunk.tool_calls else str(chunk.finish_reason)
            self.tool_calls = chunk.tool_calls
            self.usage = chunk.usage
            if chunk.stop_string:  # in the text only with include_stop_str_in_output (OutputText)
                self.stop_reason = chunk.stop_string
            elif chunk.stop_token_id is not None:  # vLLM: the id is the stop_reason
                self.stop_reason = chunk.stop_token_id
        if not self.text:
            text = self.prefix + text
        self.text.append(text)
        self.logprobs.extend(chunk.logprobs)
        self.token_ids.extend(chunk.token_ids)
        return text, chunk.logprobs, chunk.token_ids


def completion_logprobs(logprobs: list[TokenLogprobs], token_text: TokenText, offset: int,
                        token_name: Callable[[int], str] | None = None) -> dict:
    """Completions' logprobs: tokens (by ``token_name``, default their text), their logprobs, top
    alternatives and text offsets (always counted in the tokens' text). Each position's alternatives
    also hold the sampled token (OpenAI: "up to logprobs + 1 elements"), so ``logprobs: 0`` gives it alone."""
    name = token_name or token_text
    tokens, offsets, pos = [], [], offset
    for lp in logprobs:
        tokens.append(name(lp.token_id))
        offsets.append(pos)
        pos += len(token_text(lp.token_id))
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [_with_sampled({name(t): p for t, p in lp.top}, name(lp.token_id), lp.logprob)
                             for lp in logprobs], "text_offset": offsets}


def echoed_prompt_logprobs(prompt_ids: list[int], entries: list[TokenLogprobs], num_top: int,
                           token_text: TokenText, token_name: Callable[[int], str] | None = None) -> dict:
    """The echoed prompt's part of completions' logprobs (as :func:`completion_logprobs`, offsets
    from 0): its first token has no logprob and no alternatives (``null``: nothing precedes it)."""
    name = token_name or token_text
    first = prompt_ids[0]
    rest = completion_logprobs([TokenLogprobs(lp.token_id, lp.logprob, lp.top[:num_top]) for lp in entries],
                               token_text, len(token_text(first)), token_name)
    return {"tokens": [name(first), *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}


def vllm_prompt_logprobs(entries: list[TokenLogprobs], num_top: int, token_name: Callable[[int], str]) -> list:
    """vLLM's ``prompt_logprobs``: ``null`` for the first prompt token, then per token a map from
    token id (a string) to its logprob, rank and text: the prompt's token with its own rank, and the
    ``num_top`` most likely ones."""
    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_name(token_id)}
    out: list[dict | None] = [None]
    for lp in entries:
        position = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
        for rank, (token_id, logprob) in enumerate(lp.top[:num_top], 1):
            position.setdefault(str(token_id), entry(token_id, logprob, rank))
        out.append(position)
    return out


def _with_sampled(top: dict[str, float], token: str, logprob: float) -> dict[str, float]:
    top.setdefault(token, logprob)
    return top


def chat_logprobs(logprobs: list[TokenLogprobs], token_text: Callable[[int], str]) -> dict:
    """Chat's logprobs: one entry per token with its top alternatives."""
    def entry(token_id: int, logprob: float) -> dict:
        piece = token_text(token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}
    return {"content": [dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, p) for t, p in lp.top])
                        for lp in logprobs]}


class Responder:
    """Shapes one call's answers: ``chat`` picks the object kinds; ``call_id`` names the call."""

    def __init__(self, req: OpenAIRequest, *, chat: bool, call_id: str, model: str, token_text: TokenText) -> None:
        self.req = req
        self.chat = chat
        self.call_id = call_id
        self.model = model
        self.created = int(time.time())
        self._token_text = token_text
        self._token_name = token_id_text if req.tokens_as_ids else token_text  # how logprobs name a token

    def token_chars(self, logprobs: list[TokenLogprobs]) -> int:
        """The length of these tokens' text, as completions' text offsets count it."""
        return sum(len(self._token_text(lp.token_id)) for lp in logprobs)

    def _head(self, obj: str) -> dict:
        return {"id": self.call_id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, choice: ChoiceState, logprobs: list[TokenLogprobs], offset: int, *,
                  with_prompt: bool = False) -> dict | None:
        """The logprobs of ``logprobs``; ``with_prompt`` (the answer's first part), echo's prompt
        tokens before them."""
        if not self.req.logprobs:
            return None
        if self.chat:
            return chat_logprobs(logprobs, self._token_name)
        out = completion_logprobs(logprobs, self._token_text, offset, self._token_name)
        if with_prompt and self.req.echo and choice.prompt_logprobs is not None:
            num_top = self.req.inputs[0].sampling_params.logprobs or 0
            prompt = echoed_prompt_logprobs(choice.prompt_token_ids, choice.prompt_logprobs, num_top,
                                            self._token_text, self._token_name)
            out = {key: prompt[key] + out[key] for key in out}
        return out

    def _prompt_logprobs(self, choice: ChoiceState) -> list | None:
        """vLLM's ``prompt_logprobs`` of ``choice`` (None when not asked for)."""
        if self.req.prompt_logprobs is None or choice.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(choice.prompt_logprobs, self.req.prompt_logprobs, self._token_name)

    def whole(self, choices: list[ChoiceState]) -> dict:
        """The non-streamed answer."""
        out = []
        for c in choices:
            text = "".join(c.text)
            body: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                    "logprobs": self._logprobs(c, c.logprobs, len(c.prefix), with_prompt=True)}
            if self.chat:
                body["message"] = {"role": "assistant", "content": text}
                if c.tool_calls:  # OpenAI: no content (null) beside calls unless the answer had some
                    body["message"] = {"role": "assistant", "content": text if text.strip() else None,
                                       "tool_calls": [call.json() for call in c.tool_calls]}
            else:
                body["text"] = text
                if self.req.prompt_logprobs is not None:
                    body["prompt_logprobs"] = self._prompt_logprobs(c)
            out.append(body)
        usage = total_usage([c.usage for c in choices], self.req.n)
        answer = dict(self._head("chat.completion" if self.chat else "text_completion"), choices=out,
                      usage=usage_json(usage))
        if self.chat and self.req.prompt_logprobs is not None:  # vLLM: one list for the call's prompt
            answer["prompt_logprobs"] = self._prompt_logprobs(choices[0])
        return answer

    def _tool_deltas(self, choice: ChoiceState, text: str, logprobs: list[TokenLogprobs], offset: int,
                     with_prompt: bool) -> list[dict]:
        """The end of a streamed answer that called tools: its last content, then each call as
        OpenAI streams one (id, name and empty arguments, then the arguments), and
        ``finish_reason: "tool_calls"``."""
        chunks = []
        if text or logprobs:
            chunks.append(self._delta_chunk(choice, {"content": text} if text else {}, logprobs, offset, with_prompt,
                                            finish=None))
            with_prompt = False
        for k, call in enumerate(choice.tool_calls):
            head = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            chunks.append(self._delta_chunk(choice, {"tool_calls": [head]}, [], offset, with_prompt and k == 0,
                                            finish=None))
            chunks.append(self._delta_chunk(choice, {"tool_calls": [{"index": k, "function": {
                "arguments": call.arguments}}]}, [], offset, False, finish=None))
        chunks.append(self._delta_chunk(choice, {}, [], offset, False, finish="tool_calls"))
        return chunks

    def _delta_chunk(self, choice: ChoiceState, delta: dict, logprobs: list[TokenLogprobs], offset: int,
                     with_prompt: bool, *, finish: str | None) -> dict:
        body: dict[str, Any] = {"index": choice.index,
                                "logprobs": self._logprobs(choice, logprobs, offset, with_prompt=with_prompt),
                                "finish_reason": finish}
        if finish is not None:
            body["stop_reason"] = choice.stop_reason
        if not choice.started:
            delta = {"role": "assistant", **delta}
        body["delta"] = delta
        choice.started = True
        chunk = dict(self._head("chat.completion.chunk"), choices=[body])
        if with_prompt and self.req.prompt_logprobs is not None:
            chunk["prompt_logprobs"] = self._prompt_logprobs(choice)
        return self._with_usage(choice, chunk)

    def delta(self, choice: ChoiceState, text: str, logprobs: list[TokenLogprobs], offset: int, *,
              with_prompt: bool = False) -> dict | list[dict]:
        """One streamed chunk of ``choice``: new text (+ logprobs), and its finish reason on the last;
        ``with_prompt``: the chunk that brought the prompt logprobs (they go out in it). A chat with
        tools may answer with several chunks (its calls) or one without text."""
        if choice.tool_calls:
            return self._tool_deltas(choice, text, logprobs, offset, with_prompt)
        if self.chat:
            return self._delta_chunk(choice, {} if choice.started and not text else {"content": text}, logprobs,
                                     offset, with_prompt, finish=choice.finish_reason)
        body: dict[str, Any] = {"index": choice.index,
                                "logprobs": self._logprobs(choice, logprobs, offset, with_prompt=with_prompt),
                                "finish_reason": choice.finish_reason, "text": text}
        if choice.finish_reason is not None:
            body["stop_reason"] = choice.stop_reason
        choice.started = True
        if with_prompt and self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(choice)
        return self._with_usage(choice, dict(self._head("text_completion"), choices=[body]))

    def _with_usage(self, choice: ChoiceState, chunk: dict) -> dict:
        if self.req.continuous_usage:  # this choice's usage so far, as vLLM reports it
            prompt, completion = choice.num_prompt_tokens, len(choice.token_ids)
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
        elif self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, choices: list[ChoiceState]) -> dict:
        """The last chunk of a stream with ``include_usage``: no choices, the call's usage."""
        usage = total_usage([c.usage for c in choices], self.req.n)
        return dict(self._head("chat.completion.chunk" if self.chat else "text_completion"), choices=[],
                    usage=usage_json(usage))
