"""Qwen2: the Llama architecture with a bias on the Q/K/V projections.

Sliding-window attention (``use_sliding_window=True``) is not implemented and is refused.
"""

from __future__ import annotations

from typing import Any

from worker_service.models.layers import UnsupportedModelError
from worker_service.models.llama import DecoderConfig, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_from_hf(cls, hf_config: Any) -> DecoderConfig:
        if getattr(hf_config, "use_sliding_window", False):
            raise UnsupportedModelError("Qwen2 with use_sliding_window=True is not supported")
        return DecoderConfig.from_hf(hf_config, qkv_bias=True)
