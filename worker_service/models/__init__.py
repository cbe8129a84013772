"""Model families, one file each, keyed by the Hugging Face ``model_type``."""

from __future__ import annotations

from typing import Any

from worker_service.models.layers import UnsupportedModelError
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.qwen2 import Qwen2ForCausalLM

MODEL_FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}


def model_class_for(hf_config: Any) -> type[LlamaForCausalLM]:
    """The class implementing ``hf_config``'s architecture, or :class:`UnsupportedModelError` naming it."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in MODEL_FAMILIES:
        return MODEL_FAMILIES[model_type]
    archs = getattr(hf_config, "architectures", None) or []
    raise UnsupportedModelError(
        f"architecture {model_type or '?'} ({', '.join(archs) or 'no architectures listed'}) is not supported; "
        f"supported model types: {', '.join(sorted(MODEL_FAMILIES))}"
    )


__all__ = ["MODEL_FAMILIES", "UnsupportedModelError", "model_class_for"]
