"""Size and allocate the paged KV cache: one key and one value tensor per layer, allocated once.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the kernels' layout; the
memory order behind it is per device, see :func:`allocate_kv_caches`). All layers live in one tensor
so the cache is a single allocation; block 0 is the reserved null block.
"""

from __future__ import annotations

import logging
import time

import torch

from worker_service import cpu_memory
from worker_service.config import ModelRunnerConfig, parse_memory
from worker_service.models.llama import DecoderConfig

log = logging.getLogger(__name__)


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
        torch.cuda.empty_cache()  # blocks torch holds but no tensor uses (e.g. from loading) are free too
        free, total = torch.cuda.mem_get_info(device)
        budget = cuda_kv_budget(free, total, config.gpu_memory_fraction, activation_reserve(config, cfg, dtype))
    else:
        budget = parse_memory(ModelRunnerConfig.DEFAULT_CPU_KV_CACHE_MEMORY)
    num_blocks = min(budget // per_block, useful)
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory: a budget of {budget} bytes holds {max(num_blocks, 0)} blocks of {per_block} bytes; "
            "at least 2 (the null block and one more) are needed"
        )
    return int(num_blocks)


def cuda_kv_budget(free: int, total: int, gpu_memory_fraction: float, activation_reserve: int) -> int:
    """Bytes the KV cache may take on a CUDA device, from the memory ``free`` after the weights loaded.

    The stated headroom: ``(1 - gpu_memory_fraction) * total`` stays free for everything outside
    this worker's control (other processes, the CUDA context's and allocators' growth,
    fragmentation), and ``activation_reserve`` for one forward pass's transient tensors. The rest of
    what is free now is the budget. It is ``<= 0`` when the device is already fuller than that;
    the caller turns a budget too small for two blocks into an error.
    """
    headroom = round((1.0 - gpu_memory_fraction) * total)
    return free - headroom - activation_reserve


def activation_reserve(config: ModelRunnerConfig, cfg: DecoderConfig, dtype: torch.dtype) -> int:
    """A generous bound on one forward pass's transient memory: left free beside a GPU's cache, faulted
    into the heap at start on the CPU (``cpu_memory.warm_heap``)."""
    element = torch.empty((), dtype=dtype).element_size()
    tokens = config.max_num_batched_tokens
    per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size + 3 * cfg.num_heads * cfg.head_dim) * element
    logits = config.max_num_seqs * cfg.vocab_size * 4 * 4  # fp32 logits + sampler temporaries
    return 2 * tokens * per_token + logits + (256 << 20)


def allocate_kv_caches(
    cfg: DecoderConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    *, head_major: bool | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    That is the logical layout every kernel indexes by; the memory order behind it is chosen per
    device. ``head_major`` (default: on the CPU) stores ``[num_kv_heads, num_blocks, block_size,
    head_dim]`` and hands out the permuted view: the torch attention path then gathers a sequence's
    blocks as contiguous per-head tiles and its SDPA reads contiguous K/V (about 2x faster decode
    attention on the CPU than block-major storage). On CUDA the Triton kernels get plain block-major
    memory. Zero-filled so unused slots never hold NaN/inf (a masked score times a NaN value is
    still NaN). CPU memory is faulted in here, at start, not during the first requests' steps
    (``cpu_memory.populate_pages``).
    """
    if head_major is None:
        head_major = device.type == "cpu"
    kvh, dh = cfg.num_kv_heads, cfg.head_dim
    started = time.perf_counter()
    if head_major:
        storage = cpu_memory.zeros((cfg.num_layers, 2, kvh, num_blocks, block_size, dh), dtype, device, populate=True)
        storage = storage.permute(0, 1, 3, 4, 2, 5)  # the logical [L, 2, num_blocks, block_size, KVH, Dh]
    else:
        storage = cpu_memory.zeros((cfg.num_layers, 2, num_blocks, block_size, kvh, dh), dtype, device, populate=True)
    if device.type == "cpu":
        log.info("KV cache: %d blocks, %.2f GiB, memory faulted in at start in %.1f s", num_blocks,
                 storage.numel() * storage.element_size() / 2**30, time.perf_counter() - started)
    return [(storage[i, 0], storage[i, 1]) for i in range(cfg.num_layers)]

