"""Load a checkpoint through transformers and move its weights into our model definition.

transformers reads every format we accept (safetensors folders, GGUF files, which it dequantizes);
we take its config and state dict, build the family's model from :mod:`worker_service.models`, and
drop the transformers model. The architecture is checked from the config before any weight is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from paged_kernels.cpu import BF16_CPU_FLAGS, native_bf16
from servicekit.gguf_cache import hf_folder
from servicekit.model_registry import ModelSource, resolve_model
from worker_service.models import model_class_for
from worker_service.models.layers import RotaryEmbedding
from worker_service.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype of weights, activations and KV cache, and why it was picked (logged, shown in --help)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def choose_dtype(name: str, device: torch.device, hf_config: Any | None = None) -> DtypeChoice:
    """The one rule for ``--dtype``: a named dtype is taken as is; ``auto`` picks

    * on the CPU, bfloat16 when the CPU computes in bf16 natively (AMX-BF16 or AVX512-BF16, the
      flags vLLM's CPU backend checks: :func:`paged_kernels.cpu.native_bf16`), else float32 — without
      those instructions bf16 GEMMs are emulated and slower than fp32;
    * on CUDA, the checkpoint's own 16-bit type, else bfloat16 (``hf_config`` None: not known yet).
    """
    if name != "auto":
        return DtypeChoice(getattr(torch, name), "as asked")
    if device.type == "cpu":
        flag = native_bf16()
        if flag is not None:
            return DtypeChoice(torch.bfloat16, f"auto: this CPU has {flag}")
        return DtypeChoice(torch.float32, f"auto: this CPU has neither {' nor '.join(BF16_CPU_FLAGS)}")
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if stored in (torch.float16, torch.bfloat16):
        return DtypeChoice(stored, "auto: the checkpoint's 16-bit type on CUDA")
    return DtypeChoice(torch.bfloat16, "auto: bfloat16 on CUDA (the checkpoint names no 16-bit type)")


AUTO_DTYPE_RULE = (f"auto = bfloat16 on a CPU with {' or '.join(BF16_CPU_FLAGS)}, else float32; "
                   "on CUDA the checkpoint's 16-bit type, else bfloat16")


def auto_dtype_here(device: torch.device | None = None) -> str:
    """What ``auto`` picks on ``device`` (default: this machine's), as ``" (here: ...)"``; empty on
    CUDA, where it depends on the checkpoint."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cpu":
        return ""
    choice = choose_dtype("auto", device)
    return f" (here: {choice.name}, {choice.reason.removeprefix('auto: ')})"


def describe_auto_dtype(device: torch.device | None = None) -> str:
    """What ``auto`` means, and what it picks on ``device`` (default: this machine's), for ``--help``."""
    return AUTO_DTYPE_RULE + auto_dtype_here(device)


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    return choose_dtype(name, device, hf_config).dtype


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    hf_config: Any
    source: ModelSource
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    dtype_reason: str = "as asked"  # DtypeChoice.reason


def load_hf_config(source: ModelSource) -> Any:
    """The checkpoint's transformers config (a GGUF file's from its converted copy: see gguf_cache)."""
    from transformers import AutoConfig

    source = hf_folder(source, weights=False)
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
    if hf_model is None:  # a GGUF file's weights are converted once, then read from the cache (gguf_cache)
        source = hf_folder(source, weights=True)
    device = torch.device(device)
    hf_config = hf_model.config if hf_model is not None else load_hf_config(source)
    cls = model_class_for(hf_config)  # refuses unsupported architectures before reading weights
    cfg = cls.config_from_hf(hf_config)
    choice = choose_dtype(dtype, device, hf_config)
    torch_dtype = choice.dtype
    log.info("model dtype %s on %s (%s)", choice.name, device, choice.reason)
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
    return LoadedModel(ours, hf_config, source, _eos_token_ids(hf_model, hf_config), torch_dtype, choice.reason)


def _eos_token_ids(hf_model: Any, hf_config: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for holder in (getattr(hf_model, "generation_config", None), hf_config):
        value = getattr(holder, "eos_token_id", None) if holder is not None else None
        for token in [value] if isinstance(value, int) else (value or []):
            if token not in ids:
                ids.append(int(token))
    return tuple(ids)
