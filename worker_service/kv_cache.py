"""Size and allocate the paged KV cache: one key and one value tensor per layer, allocated once.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the kernels' layout). All
layers live in one tensor so the cache is a single allocation; block 0 is the reserved null block.
"""

from __future__ import annotations

import torch

from worker_service.config import ModelRunnerConfig, parse_memory
from worker_service.models.llama import DecoderConfig


def bytes_per_block(cfg: DecoderConfig, block_size: int, dtype: torch.dtype) -> int:
    """Memory of one block across all layers, keys and values."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element


def determine_num_blocks(
    config: ModelRunnerConfig, cfg: DecoderConfig, dtype: torch.dtype, device: torch.device, max_model_len: int
) -> int:
    """Blocks (including the null block) the configured budget pays for, at least 2."""
    per_block = bytes_per_block(cfg, config.block_size, dtype)
    # more than every sequence at full length could ever hold is wasted memory
    useful = config.max_num_seqs * -(-max_model_len // config.block_size) + 1
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_memory is not None:
        budget = parse_memory(config.kv_cache_memory)
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_fraction) - _activation_reserve(config, cfg, dtype)
    else:
        budget = parse_memory(ModelRunnerConfig.DEFAULT_CPU_KV_CACHE_MEMORY)
    num_blocks = min(budget // per_block, useful)
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory: a budget of {budget} bytes holds {max(num_blocks, 0)} blocks of {per_block} bytes; "
            "at least 2 (the null block and one more) are needed"
        )
    return int(num_blocks)


def _activation_reserve(config: ModelRunnerConfig, cfg: DecoderConfig, dtype: torch.dtype) -> int:
    """A generous bound on one forward pass's transient memory (left free beside the cache)."""
    element = torch.empty((), dtype=dtype).element_size()
    tokens = config.max_num_batched_tokens
    per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size + 3 * cfg.num_heads * cfg.head_dim) * element
    logits = config.max_num_seqs * cfg.vocab_size * 4 * 4  # fp32 logits + sampler temporaries
    return 2 * tokens * per_token + logits + (256 << 20)


def allocate_kv_caches(
    cfg: DecoderConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Zero-filled so unused slots never hold NaN/inf (a masked score times a NaN value is still NaN).
    """
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    storage = torch.zeros(shape, dtype=dtype, device=device)
    return [(storage[i, 0], storage[i, 1]) for i in range(cfg.num_layers)]
