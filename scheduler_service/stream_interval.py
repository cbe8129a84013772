"""Fewer, larger output records: a request's tokens are published once ``interval`` of them are
waiting (``--stream-interval``, as SGLang's ``stream_interval``), instead of one record per step.

Every token a client receives costs CPU on the way (a Redis entry, the gateway's read and
detokenization, one gRPC message, the client's read): on a machine where those services share the
cores with the worker, that is time the forward pass loses. With ``interval`` N a running request
publishes every N steps; its first tokens still go out at once (time to first token is unchanged)
and so does its last record (the finish is never held). Held tokens are at most N - 1 per request
and are published before the request leaves this engine any other way (an error, a
hand-back to another worker); a scheduler that dies with tokens held never published them, so
the request's next scheduler recomputes them (decision 5 holds: nothing a client received is
regenerated).
"""

from __future__ import annotations

from collections.abc import Iterable

from servicekit.contract.step import EngineCoreOutput


def _merge(first: EngineCoreOutput, then: EngineCoreOutput) -> EngineCoreOutput:
    """One record of two consecutive ones of a request."""
    logprobs = None
    if first.new_logprobs is not None or then.new_logprobs is not None:
        logprobs = list(first.new_logprobs or ()) + list(then.new_logprobs or ())
    return EngineCoreOutput(first.request_id, first.new_token_ids + then.new_token_ids, first.first_index,
                            finish_reason=then.finish_reason, new_logprobs=logprobs,
                            num_cached_tokens=max(first.num_cached_tokens, then.num_cached_tokens),
                            prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs)


class StreamBatcher:
    """Per engine: the step outputs to publish now, the rest held until ``interval`` tokens wait.

    Invariant: ``_held`` has at most one record per request, with fewer than ``interval`` tokens,
    of a request whose first tokens went out (``_started``) and that has not finished."""

    def __init__(self, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"stream interval: must be >= 1, got {interval}")
        self.interval = interval
        self._held: dict[str, EngineCoreOutput] = {}
        self._started: set[str] = set()

    @property
    def num_held_tokens(self) -> int:
        return sum(len(o.new_token_ids) for o in self._held.values())

    def take(self, outputs: Iterable[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Of one step's outputs (merged with what each request held), those to publish now, in order."""
        if self.interval == 1:  # nothing is ever held
            return list(outputs)
        ready: list[EngineCoreOutput] = []
        for out in outputs:
            rid = out.request_id
            held = self._held.pop(rid, None)
            if held is not None:
                if held.first_index + len(held.new_token_ids) == out.first_index:
                    out = _merge(held, out)
                else:  # not the continuation (cannot happen while indices are never reused): both, in order
                    ready.append(held)
            if out.finished:
                self._started.discard(rid)
                ready.append(out)
            elif rid not in self._started or len(out.new_token_ids) >= self.interval:
                if out.new_token_ids:
                    self._started.add(rid)
                ready.append(out)
            else:
                self._held[rid] = out
        return ready

    def flush(self, request_ids: Iterable[str] | None = None) -> list[EngineCoreOutput]:
        """The held records of ``request_ids`` (None: all), now; those requests are forgotten."""
        if request_ids is None:
            flushed = list(self._held.values())
            self._held.clear()
            self._started.clear()
            return flushed
        flushed = []
        for rid in request_ids:
            held = self._held.pop(rid, None)
            if held is not None:
                flushed.append(held)
            self._started.discard(rid)
        return flushed

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop what ``request_ids`` hold without publishing (requests another scheduler took over)."""
        self.flush(request_ids)
