"""The text path, once for both engines (docs/architecture.md, decision 7): the gateway and ``pagedserve.LLM``
load the tokenizer, apply chat templates, detokenize incrementally and match stop strings with
this module, so the same request gives the same tokens and text in-process and served.

- :func:`load_tokenizer` / :class:`PromptTokenizer`: text or a conversation to prompt token ids;
- :class:`IncrementalDetokenizer`: one token at a time to text that never ends in a broken
  multi-byte character (a small window of the prompt's last tokens gives context, so a token's
  leading space survives; text is released once it no longer ends in U+FFFD);
- :class:`StopStringMatcher`: releases text only when no stop string could still start in it, so
  a reader never sees part of a stop string;
- :class:`OutputText`: the two together, per request: tokens in, (text, stop string) out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jinja2

from servicekit.contract.errors import InvalidArgumentError


def load_tokenizer(model: str) -> Any:
    """The Hugging Face tokenizer of ``model`` (a short name, a folder or a .gguf file; a GGUF
    file's is converted once and read from the model cache after: ``servicekit.gguf_cache``)."""
    from transformers import AutoTokenizer

    from servicekit.gguf_cache import hf_folder
    from servicekit.model_registry import resolve_model

    try:
        source = hf_folder(resolve_model(model), weights=False)
        return AutoTokenizer.from_pretrained(source.path, **source.from_pretrained_kwargs())
    except (OSError, ValueError) as e:
        raise InvalidArgumentError("tokenizer", f"cannot load one from {model!r} ({e})") from e


def backend_encode(tokenizer: Any) -> Callable[[str, bool], list[int] | None] | None:
    """The ``tokenizers`` library's own encode without offsets (``encode_batch_fast``), where
    ``tokenizer.encode`` is that library's ``encode_batch`` and nothing more — transformers' fast
    tokenizer whose encode path no subclass changes — else None. The ids are the same; the offsets,
    which nothing here reads, and transformers' wrapping cost ~45 % of a long prompt's tokenizing
    (7,450 characters: 2.2 against 1.3 ms). The returned function gives None when the backend's state
    is not the one ``tokenizer.encode`` sets for a plain call (truncation or padding on, special
    tokens split otherwise): then take ``tokenizer.encode``."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its own encode
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(tokenizer, TokenizersBackend) or not hasattr(backend, "encode_batch_fast")
            or type(tokenizer)._encode_plus is not TokenizersBackend._encode_plus
            or type(tokenizer).encode is not PreTrainedTokenizerBase.encode):
        return None
    def encode(text: str, add_special_tokens: bool) -> list[int] | None:
        if (backend.truncation is not None or backend.padding is not None
                or backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False))):
            return None
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    return encode


class PromptTokenizer:
    """Prompt token ids from text or a conversation, the same way everywhere."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self._encode = backend_encode(hf_tokenizer)

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Plain text, special tokens added as the model does (unless ``add_special_tokens`` is off)."""
        ids = None if self._encode is None else self._encode(text, add_special_tokens)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens)) if ids is None else ids

    def chat_text(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True,
                  continue_final_message: bool = False, chat_template: str | None = None,
                  template_kwargs: dict | None = None) -> str:
        """A conversation through the chat template (with a generation prompt by default).
        ``continue_final_message``: the text ends inside the last turn, an assistant's, so the
        model continues it (a prefilled reply; then ``add_generation_prompt`` must be off).
        ``template_kwargs``: extra variables the template reads (``enable_thinking``)."""
        if not messages:
            raise InvalidArgumentError("messages", "at least one message is required")
        if chat_template is None and getattr(self.hf, "chat_template", None) is None:
            raise InvalidArgumentError("messages", "the model has no chat template")
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidArgumentError("continue_final_message", "cannot be combined with add_generation_prompt "
                                                                     "(set add_generation_prompt to false)")
            if messages[-1]["role"] != "assistant":
                raise InvalidArgumentError("continue_final_message", "the last message must be the assistant's")
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               chat_template=chat_template, **(template_kwargs or {}))
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            # a template refusing the turns (raise_exception: "roles must alternate user/assistant"), one
            # that does not render the final message's text as given, or template_kwargs it cannot use
            raise InvalidArgumentError("messages", f"the chat template cannot render them: {exc}") from None

    def encode_chat(self, messages: list[dict[str, str]], *, check_size: Callable[[int], None] | None = None,
                    **template_options) -> list[int]:
        """The token ids of :meth:`chat_text` (the template already holds the special tokens).
        ``check_size`` is given the rendered text's size in bytes before it is tokenized (a template
        may add much to the turns: its own text, template variables, a variable per turn)."""
        text = self.chat_text(messages, **template_options)
        if check_size is not None:
            check_size(len(text.encode()))
        return self.encode_text(text, add_special_tokens=False)


REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first outputs, for spacing


def backend_decode(tokenizer: Any):
    """The ``tokenizers`` library's own decode, where it gives exactly what ``tokenizer.decode``
    gives — a fast tokenizer that does not clean up tokenization spaces (transformers' decode is
    then that call plus argument handling, which costs ~3x the decode of a few tokens) — else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode


class IncrementalDetokenizer:
    """Invariant: the concatenation of every :meth:`add` result plus :meth:`flush` equals the text
    of all tokens added, decoded in the context of the prompt's last tokens."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], *, skip_special_tokens: bool = True) -> None:
        self._skip = skip_special_tokens
        self._decode_with = backend_decode(tokenizer) or tokenizer.decode  # (ids, skip_special_tokens=...)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(context)  # tokens before this are released as text

    def _decode(self, ids: list[int]) -> str:
        return self._decode_with(ids, skip_special_tokens=self._skip)

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



class OutputText:
    """The text of one request's output, token by token: detokenized, stops applied as vLLM does.

    Invariant: the pieces returned by :meth:`add` and :meth:`finish` join to the output's text up to
    (not including) the first stop string, which :meth:`add` reports with the token that completed it,
    and without the text of a stop token (EOS or a stop id) that ends the output. With
    ``include_stops`` (vLLM's include_stop_str_in_output) both are part of the text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...] = (), *,
                 skip_special_tokens: bool = True, include_stops: bool = False) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens)
        self._matcher = StopStringMatcher(stop)
        self._include_stops = include_stops

    def add(self, token_id: int, *, ends_output: bool = False) -> tuple[str, str | None]:
        """The text ``token_id`` releases, and the stop string it completed (then the output ends).
        ``ends_output``: the token ended the output as a stop token, so it adds no text (unless stops
        are included)."""
        if ends_output and not self._include_stops:
            return "", None
        return self._stopped(*self._matcher.feed(self._detokenizer.add(token_id)))

    def finish(self) -> tuple[str, str | None]:
        """At the output's end: the text still held back, and a stop string it completed, if any."""
        piece, stop = self._matcher.feed(self._detokenizer.flush())
        return self._stopped(piece, stop) if stop is not None else (piece + self._matcher.flush(), None)

    def _stopped(self, piece: str, stop: str | None) -> tuple[str, str | None]:
        return (piece + stop, stop) if stop is not None and self._include_stops else (piece, stop)
