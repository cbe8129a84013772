"""Random-weight models of real shapes, built in code (nothing is downloaded): a Llama-3.2-1B-like
and a Qwen2.5-0.5B-like config, and a tiny version of each for dry runs. With ``ignore_eos`` the
weights' values do not matter to throughput; the shapes (and so the bytes read per step) do.

A served model also needs a tokenizer for the gateway: a word-level one over the whole vocabulary
(``<t123>`` for id 123) is made in code too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# max_position_embeddings is cut to what the workloads need: the RoPE tables and the engine's
# per-request block-table width follow it, the bytes read per step do not.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b-like": dict(
        family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
    ),
    "qwen2.5-0.5b-like": dict(
        family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0,
        rms_norm_eps=1e-6, max_position_embeddings=2048, use_sliding_window=False,
    ),
}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_config(name: str, dry: bool) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    values = dict(SHAPES[name])
    family = values.pop("family")
    if dry:
        values.update(TINY)
    values.update(SPECIAL, dtype="bfloat16")
    return (LlamaConfig if family == "llama" else Qwen2Config)(**values)


def build_model(name: str, dry: bool, device: str, dtype: Any) -> Any:
    """The model with transformers' random initialisation, made directly on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(make_config(name, dry), dtype=dtype)
    return model.eval()


def save_with_tokenizer(model: Any, folder: Path) -> Path:
    """A Hugging Face folder (config, weights, tokenizer) that workers and gateways load by path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(model.config.vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<t0>", pad_token="<t0>",
                                        bos_token="<t1>", eos_token="<t2>")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def weight_bytes_per_step(model: Any) -> int:
    """Bytes of weights one forward pass reads: every parameter once (a tied embedding is the LM
    head's matrix), except an untied input embedding, of which only the batch's rows are read."""
    seen, total = set(), 0
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        if "embed" in name and getattr(model, "lm_head", None) is not None:
            continue
        total += param.numel() * param.element_size()
    return total


def kv_bytes_per_token(config: Any, dtype: Any) -> int:
    """K and V of one position across all layers."""
    import torch

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
