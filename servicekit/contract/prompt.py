"""What a prompt must be for a model: the one length rule, and the checks that use it.

Called where untrusted input enters (the gateway; ``pagedserve.LLM`` for its callers) and by the
scheduler's routing (which worker can take a request); inner services trust what passed.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.sampling_params import INT32_MAX

if TYPE_CHECKING:
    from servicekit.contract.sampling_params import SamplingParams


def check_text(field: str, text: str) -> None:
    """Refuse a string that is not Unicode text: one holding a lone surrogate (U+D800..U+DFFF, what a
    JSON ``"\\ud800"`` escape or a bad decode leaves), which UTF-8, the tokenizer and the wire cannot
    encode. Cheap for ASCII."""
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise InvalidArgumentError(field, f"must be Unicode text; a lone surrogate ({text[exc.start]!r} at "
                                              f"{exc.start}) is not") from None


def token_id_list(value: object, field: str = "prompt") -> list[int]:
    """A caller's token ids as a list: any iterable of integers (numpy's too), each in [0, 2**31)
    (what the wire's ids hold; the vocabulary is checked where it is known, :func:`check_prompt`).
    Bytes, a mapping, a float or a boolean id is refused naming ``field``: never truncated (1.7 is
    not 1) or read as something else (``b"hi"`` is not the ids 104, 105)."""
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(field, f"must be text or a list of token ids, got {type(value).__name__}")
    ids = []
    for token in value:
        if isinstance(token, bool):
            raise InvalidArgumentError(field, f"token ids must be integers, got {token!r}")
        try:
            token_id = operator.index(token)
        except TypeError:
            raise InvalidArgumentError(field, f"token ids must be integers, got {token!r}") from None
        if not 0 <= token_id <= INT32_MAX:
            raise InvalidArgumentError(field, f"token id {token_id} is out of vocabulary (ids are >= 0 and < 2**31)")
        ids.append(token_id)
    return ids


def length_error(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> InvalidArgumentError | None:
    """The length rule: a prompt leaves room for one output token, and prompt + max_tokens fit
    ``max_model_len``. The error naming the field at fault, or None when the request fits. Its text
    begins as OpenAI's and vLLM's do ("This model's maximum context length is ..."): clients
    (LiteLLM, agent frameworks) recognise a context overflow by it."""
    total = f"This model's maximum context length is {max_model_len} tokens. However, you requested " \
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, " \
            f"{max_tokens} for the completion)"
    if num_prompt_tokens >= max_model_len:
        return InvalidArgumentError("prompt", f"{total}: a prompt takes at most {max_model_len - 1} tokens")
    if num_prompt_tokens + max_tokens > max_model_len:
        return InvalidArgumentError("max_tokens", f"{total}: lower max_tokens to at most "
                                                  f"{max_model_len - num_prompt_tokens} or shorten the prompt")
    return None


def truncate_prompt(prompt_token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``; -1: ``max_model_len``;
    None: all of it); any other value is refused naming ``truncate_prompt_tokens``."""
    if keep is None:
        return prompt_token_ids
    if keep == -1:
        keep = max_model_len
    elif isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise InvalidArgumentError("truncate_prompt_tokens", f"must be -1 or at least 1, got {keep!r}")
    return prompt_token_ids[-keep:]


def check_allowed_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> None:
    """Refuse allowed ids that leave nothing to sample while ``min_tokens`` applies: every one a stop
    token id or (unless ``ignore_eos``) an EOS id, which min_tokens bans."""
    if not params.allowed_token_ids or not params.min_tokens:
        return
    ending = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    if set(params.allowed_token_ids) <= ending:
        raise InvalidArgumentError("allowed_token_ids", "every allowed id ends the request (a stop token id or "
                                                        "EOS), which min_tokens forbids: nothing could be sampled")


def check_prompt(prompt_token_ids: Sequence[int], max_tokens: int, *, max_model_len: int, vocab_size: int,
                 field: str = "prompt", logit_bias: Sequence[tuple[int, float]] = (),
                 allowed_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = ()) -> None:
    """Raise InvalidArgumentError unless the prompt is non-empty, its ids are in the vocabulary
    (``field`` names where they came from), it passes the length rule and the ids of
    ``logit_bias``, ``allowed_token_ids`` (SamplingParams', ascending) and ``stop_token_ids`` are in
    the vocabulary too (a stop id past it could never be sampled: a caller's mistake, not a no-op)."""
    outside = [t for t in stop_token_ids if t >= vocab_size]
    if outside:
        raise InvalidArgumentError("stop_token_ids", f"token id {outside[0]} is out of vocabulary (ids must be in "
                                                     f"[0, {vocab_size}))")
    if logit_bias and logit_bias[-1][0] >= vocab_size:
        raise InvalidArgumentError("logit_bias", f"token ids must be in [0, {vocab_size}), got {logit_bias[-1][0]}")
    if allowed_token_ids and allowed_token_ids[-1] >= vocab_size:
        raise InvalidArgumentError("allowed_token_ids",
                                   f"token ids must be in [0, {vocab_size}), got {allowed_token_ids[-1]}")
    if not prompt_token_ids:
        raise InvalidArgumentError("prompt", "must contain at least one token")
    try:
        lo, hi = min(prompt_token_ids), max(prompt_token_ids)
    except TypeError:
        raise InvalidArgumentError(field, "token ids must be integers") from None
    if lo < 0 or hi >= vocab_size:
        raise InvalidArgumentError(field, f"token id {lo if lo < 0 else hi} is out of vocabulary (ids must be in "
                                          f"[0, {vocab_size}))")
    error = length_error(len(prompt_token_ids), max_tokens, max_model_len)
    if error is not None:
        raise error
