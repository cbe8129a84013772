"""Draft tokens by prompt lookup (n-gram speculation): guess a request's next tokens from its own past.

When the last ``n`` tokens of a request (prompt + outputs) occurred before, the tokens that followed
their most recent earlier occurrence are proposed as drafts; the longest such ``n`` in
``[min_n, max_n]`` wins (vLLM's ``ngram`` method, llama.cpp's lookup decoding). The worker proposes
them with a step's answer, the scheduler schedules them in the request's next step, and that step
computes them after the request's last token and keeps the leading drafts that equal the tokens it
samples there, plus the one it samples after them (``servicekit.contract.step``): the output is
token for token what one-at-a-time decoding samples, so a wrong guess costs compute, never
correctness.

A request's :class:`NgramIndex` is kept up to date as its tokens are appended (each new token adds
one entry per ``n``), so a proposal is ``max_n - min_n + 1`` dictionary lookups, not a search of the
context.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """One request's tokens and where each of their n-grams last occurred with a token after it.

    Invariant (after each :meth:`propose`): for every ``n`` in ``[min_n, max_n]`` and every end ``e``
    in ``[n, len(tokens))``, ``last[tuple(tokens[e - n:e])]`` is the largest such ``e`` with that
    n-gram (its successor is ``tokens[e]``). The n-grams ending at the last token are not entered
    until a token follows them, so a lookup of the sequence's own suffix finds an *earlier*
    occurrence.
    """

    __slots__ = ("min_n", "max_n", "tokens", "last", "indexed")

    def __init__(self, min_n: int, max_n: int, tokens: Iterable[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens = list(tokens)  # the request's token ids (prompt + outputs), appended to only
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence with a successor
        self.indexed = 0  # ends below this are entered

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append the request's new tokens (entered in the index at the next proposal)."""
        self.tokens.extend(token_ids)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` drafts to follow the tokens, or [] when their suffix never occurred before."""
        if k <= 0:
            return []
        tokens, last = self.tokens, self.last
        lo, hi, end = self.min_n, self.max_n, len(tokens)
        for e in range(max(self.indexed, lo), end):  # n-grams that gained a successor, oldest first
            for n in range(lo, min(hi, e) + 1):
                last[tuple(tokens[e - n:e])] = e
        self.indexed = end
        for n in range(min(hi, end - 1), lo - 1, -1):
            start = last.get(tuple(tokens[end - n:end]))
            if start is not None:
                return tokens[start:start + k]
        return []
