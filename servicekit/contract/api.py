"""What the gateway's API returns beside text: the served model's facts and a request's token counts.

The gateway answers with these and the SDK hands the same classes to its callers, so a field means
one thing on both sides of the wire.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The model a gateway serves, as its live workers report it (``servicekit.registry``)."""

    model: str
    max_model_len: int  # the smallest over the model's workers: any of them can take a request
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_workers: int
    block_size: int
    # (field, value) a sampling field a request leaves unset takes (the gateway's --sampling-defaults)
    sampling_defaults: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """The token counts of one request."""

    prompt_tokens: int  # after the chat template
    completion_tokens: int
    cached_prompt_tokens: int  # served from the prefix cache
