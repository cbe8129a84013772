"""Load a checkpoint through transformers and move its weights into our model definition.

transformers reads every format we accept (safetensors folders, GGUF files, which it dequantizes);
we take its config and state dict, build the family's model from :mod:`worker_service.models`, and
drop the transformers model. The architecture is checked from the config before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from servicekit.model_registry import ModelSource, resolve_model
from worker_service.models import model_class_for
from worker_service.models.layers import RotaryEmbedding
from worker_service.models.llama import LlamaForCausalLM


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    hf_config: Any
    source: ModelSource
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_hf_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.path, **source.from_pretrained_kwargs())


def load_model(
    model: str | ModelSource,
    *,
    dtype: str = "auto",
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    hf_model: Any | None = None,
) -> LoadedModel:
    """Load ``model`` (a name for :func:`resolve_model`) onto ``device``.

    ``hf_model``: an already loaded transformers model of the same checkpoint, reused instead of
    loading it again (tests compare against it). ``max_positions``: rows of the RoPE tables
    (default: the model's ``max_position_embeddings``).
    """
    if isinstance(model, ModelSource):
        source = model
    elif hf_model is not None:  # the weights are at hand: ``model`` only names them
        source = ModelSource(name=model, path=getattr(hf_model, "name_or_path", "") or model)
    else:
        source = resolve_model(model)
    device = torch.device(device)
    hf_config = hf_model.config if hf_model is not None else load_hf_config(source)
    cls = model_class_for(hf_config)  # refuses unsupported architectures before reading weights
    cfg = cls.config_from_hf(hf_config)
    torch_dtype = resolve_dtype(dtype, hf_config, device)
    if hf_model is None:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            source.path, dtype=torch_dtype, **source.from_pretrained_kwargs()
        )
    state = hf_model.state_dict()
    max_positions = max_positions or cfg.max_position_embeddings
    with torch.device("meta"):  # no random init: every parameter is overwritten below
        ours = cls(cfg, max_positions).to(torch_dtype)
    ours = ours.to_empty(device=device)
    ours.rope = RotaryEmbedding(cfg.inv_freq, max_positions).to(device)  # buffers were on meta
    ours.load_hf_state_dict(state)
    ours.eval().requires_grad_(False)
    return LoadedModel(ours, hf_config, source, _eos_token_ids(hf_model, hf_config), torch_dtype)


def _eos_token_ids(hf_model: Any, hf_config: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for holder in (getattr(hf_model, "generation_config", None), hf_config):
        value = getattr(holder, "eos_token_id", None) if holder is not None else None
        for token in [value] if isinstance(value, int) else (value or []):
            if token not in ids:
                ids.append(int(token))
    return tuple(ids)
