"""Structured output where the logits are: one grammar matcher per constrained row of the batch.

A constrained request gets its matcher when its row is given (``InputBatch.add``): the grammar is
compiled (cached by its text) in a background thread while the request's prompt is computed, and
the matcher is brought to the request's state by accepting the output tokens it already has — a
request that moved (preemption, a worker's death, a resumed stream) continues exactly where the
tokens it delivered left the grammar. Each step, the rows that sample and are constrained get
their next-token bitmask (``[rows, ceil(V / 32)]`` int32; the sampler masks every other token),
and every sampled token advances its row's matcher. Nothing crosses the wire per step: the mask
stays here, the step payload stays O(changes).

Rows without a constraint cost nothing: with none in the batch no method here does any work.
The grammar engine is imported only when the first constrained request arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from servicekit.contract.structured_output import StructuredOutput

log = logging.getLogger(__name__)


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word, as a signed value (bit 31 is negative)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


class StructuredRows:
    """Row → matcher for the constrained rows of one persistent batch."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], make_compiler: Callable[[], Any]) -> None:
        self.vocab_size = vocab_size
        self._eos = [t for t in eos_token_ids if t < vocab_size]
        self._make_compiler = make_compiler
        self._compiler: Future | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._matchers: dict[int, Future] = {}  # row -> Future[matcher or None (failed)]

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, row: int) -> bool:
        return row in self._matchers

    def add(self, row: int, constraint: StructuredOutput, output_token_ids: list[int]) -> None:
        """Start building ``row``'s matcher (compiled off the step's thread)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            self._compiler = self._pool.submit(self._make_compiler)
        self._matchers[row] = self._pool.submit(self._build, constraint, list(output_token_ids))

    def _build(self, constraint: StructuredOutput, output_token_ids: list[int]) -> Any:
        try:
            matcher = self._compiler.result().matcher(constraint)
        except Exception:
            log.exception("structured output: cannot compile the %s constraint; the request ends here", constraint.kind)
            return None
        for i, token in enumerate(output_token_ids):  # the state its delivered tokens reached
            if not matcher.accept_token(token):
                log.error("structured output: delivered token %d (output index %d) is outside the grammar; "
                          "the request ends here", token, i)
                return None
        return matcher

    def remove(self, row: int) -> None:
        self._matchers.pop(row, None)

    def bitmask(self, rows: np.ndarray) -> tuple[np.ndarray, torch.Tensor] | None:
        """(indices into ``rows`` that are constrained, their next-token bitmask ``[k, ceil(V/32)]``
        int32: bit ``t % 32`` of word ``t // 32`` set = token t allowed), or None when no row is.
        A row whose matcher could not be built, or whose grammar already ended, may only end:
        EOS alone is allowed."""
        picked = [(i, self._matchers[r]) for i, r in enumerate(rows.tolist()) if r in self._matchers]
        if not picked:
            return None
        words = -(-self.vocab_size // 32)
        mask = torch.zeros((len(picked), words), dtype=torch.int32)
        for k, (_, future) in enumerate(picked):
            matcher = future.result()
            # A matcher that accepted its stop token has nothing to allow: a step scheduled before
            # the scheduler saw that token end the request samples once more, and that token is
            # dropped (EOS keeps the row well-defined).
            if matcher is None or matcher.is_terminated():
                for t in self._eos:
                    mask[k, t // 32] |= _bit(t % 32)
            else:
                matcher.fill_next_token_bitmask(mask, k)
        return np.array([i for i, _ in picked], dtype=np.int64), mask

    def accept(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Advance each constrained row's matcher by the token it sampled."""
        for row, token in zip(rows.tolist(), token_ids.tolist()):
            future = self._matchers.get(row)
            if future is None:
                continue
            matcher = future.result()
            if matcher is not None and not matcher.is_terminated() and not matcher.accept_token(int(token)):
                log.error("structured output: sampled token %d is outside the grammar (row %d)", token, row)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
