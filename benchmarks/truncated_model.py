"""A model's first N decoder layers as a Hugging Face folder, for benchmarks that need a fast CPU's
step time on a slow one.

The served stack's other processes (gateway, scheduler, Redis, the client) cost about the same CPU
per token whatever the model, so how much they take from the worker depends on how fast the worker
steps. SmolLM2-135M with 5 of its 30 layers steps on a 2-core AVX2 host (fp32) about as fast as all
30 do on a 2-core AMX-BF16 host (bf16): 64 requests, ~480-520 output tok/s either way. Weights
are the model's own (a GGUF is dequantized), saved as fp32 safetensors with its tokenizer; the
outputs are not the full model's, the per-token work around them is.
"""

from __future__ import annotations

from pathlib import Path


def first_layers(model: str, num_layers: int, folder: Path) -> str:
    """Save ``model`` (a short name, folder or ``.gguf``) cut to its first ``num_layers`` decoder
    layers into ``folder``; returns the folder's path, which the stack and ``pagedserve.LLM`` load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from servicekit.model_registry import resolve_model

    source = resolve_model(model)
    kwargs = source.from_pretrained_kwargs()
    loaded = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, **kwargs)
    total = loaded.config.num_hidden_layers
    if not 0 < num_layers <= total:
        raise ValueError(f"--num-layers: {model} has {total} decoder layers, asked for {num_layers}")
    config = loaded.config
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    if hasattr(config, "quantization_config"):  # a GGUF's: the saved weights are plain fp32
        del config.quantization_config
    cut = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kept = {k: v for k, v in loaded.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    cut.load_state_dict(kept)
    cut.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source.path, **kwargs).save_pretrained(folder)
    return str(folder)
