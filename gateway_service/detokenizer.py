"""Incremental detokenization and stop-string matching, per request, at the gateway (DESIGN.md
decision 7).

:class:`IncrementalDetokenizer` turns one token at a time into text that never ends in a broken
multi-byte character: it decodes a small window (the last few prompt tokens for context, so a
token's leading space survives) and only releases text once it no longer ends in U+FFFD.
:class:`StopStringMatcher` releases text only when no stop string could still start in it, so a
client never sees part of a stop string.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first outputs, for spacing


class IncrementalDetokenizer:
    """Invariant: the concatenation of every :meth:`add` result plus :meth:`flush` equals the text
    of all tokens added, decoded in the context of the prompt's last tokens."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # tokens before this are released as text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        ids = self._ids
        ids.append(token_id)
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(ids[self._prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever text is still held back (at the end of the output, broken characters included)."""
        ids = self._ids
        if self._read_offset == len(ids):
            return ""
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(ids)
        return full_text[len(prefix_text):]


class StopStringMatcher:
    """Holds back the tail of the text that could still begin a stop string.

    Invariant: released text never contains, nor ends with the beginning of, a stop string; so a
    match always starts inside the held-back text or the new text.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = tuple(stop)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to release, the stop string if one completed). After a match the
        text from the stop string on is dropped and the matcher is done."""
        if not self._stop:
            return text, None
        buf = self._held + text
        match_at, matched = -1, None
        for s in self._stop:
            i = buf.find(s)
            if i >= 0 and (match_at < 0 or i < match_at):
                match_at, matched = i, s
        if matched is not None:
            self._held = ""
            return buf[:match_at], matched
        hold = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
