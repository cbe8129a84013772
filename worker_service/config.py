"""Settings of one model runner (frozen, validated at construction)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kernels import BACKENDS as ATTENTION_BACKENDS
from servicekit.contract.errors import InvalidArgumentError
from servicekit.flags import setting
from worker_service.loader import describe_auto_dtype

DTYPES = ("auto", "float32", "bfloat16", "float16")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_memory(value: str | int, field: str = "kv_cache_memory") -> int:
    """Bytes from ``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or a plain integer."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    elif isinstance(value, str) and (m := re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)):
        number, unit = float(m.group(1)), m.group(2).lower()
    else:
        raise InvalidArgumentError(field, f"expected a size such as '2GiB' or a byte count, got {value!r}")
    if unit not in _UNITS:
        raise InvalidArgumentError(field, f"unknown unit {unit!r} (use B, KiB, MiB, GiB, KB, MB, GB)")
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise InvalidArgumentError(field, f"must be positive, got {value!r}")
    return size


@dataclass(frozen=True, slots=True)
class ModelRunnerConfig:
    """What a worker needs to load a model and size its KV cache and persistent batch.

    KV-cache size, first match wins: ``num_blocks`` (exact, incl. the null block) →
    ``kv_cache_memory`` (bytes) → on CUDA the memory free after loading the weights minus a headroom
    of ``1 - gpu_memory_fraction`` of the device's total memory and an activation reserve
    (``worker_service.kv_cache.cuda_kv_budget``) → on CPU ``DEFAULT_CPU_KV_CACHE_MEMORY``. Never more blocks than ``max_num_seqs``
    full-length sequences can use.
    """

    model: str = setting("smollm2-135m", help="short name (smollm2-135m), Hugging Face folder, or .gguf file")
    dtype: str = setting("auto", choices=DTYPES,
                         help=f"weights, activations and KV-cache dtype; {describe_auto_dtype()}")
    device: str | None = setting(None, type=str, help="torch device (default: cuda if available, else cpu)")
    block_size: int = setting(16, help="tokens per KV-cache block")
    max_num_seqs: int = setting(128, help="rows of the persistent batch")
    max_num_batched_tokens: int = setting(2048, help="tokens per step at most")
    max_model_len: int | None = setting(None, type=int,
                                        help="prompt + output tokens at most (default: the model's "
                                             "max_position_embeddings)")
    kv_cache_memory: str | int | None = setting(
        None, type=str, help="KV-cache budget such as 2GiB (default: from free GPU memory, 1GiB on CPU)")
    gpu_memory_fraction: float = setting(
        0.9, help="share of the GPU's total memory this worker may hold; the rest stays free as headroom")
    num_blocks: int | None = setting(None, type=int, help="exact KV blocks incl. the null block (default: from "
                                                          "memory)")
    prefill_chunk_attention_limit: int = setting(
        -1, help="key positions one prefill chunk should attend at most (tokens x context), stated to schedulers "
                 "so a step stays short at any context (-1: 1048576 on a CPU, no limit on CUDA; 0: no limit)")
    attention_backend: str = setting("auto", choices=ATTENTION_BACKENDS, help="paged-attention implementation: " + "; ".join(
        f"{name} = {what}" for name, what in ATTENTION_BACKENDS.items()))
    # CPU tuning (no effect on CUDA)
    native_kernels: bool = setting(True, help="build and use the C attention kernel (kernels/csrc/) where a "
                                              "C compiler is present")
    kernel_cache: str = setting("", help="where built C kernels are cached (default: ~/.cache/pagedserve/kernels)")
    prepack_weights: bool = setting(True, help="lay bf16 linear weights out once for oneDNN's GEMM (bit-identical "
                                                "outputs; faster small batches)")
    tune_malloc: bool = setting(True, help="raise glibc's malloc thresholds so per-step activations reuse warm "
                                           "memory (process-wide)")

    DEFAULT_CPU_KV_CACHE_MEMORY = "1GiB"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidArgumentError("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidArgumentError(
                "attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if (isinstance(self.prefill_chunk_attention_limit, bool) or not isinstance(self.prefill_chunk_attention_limit, int)
                or self.prefill_chunk_attention_limit < -1):
            raise InvalidArgumentError("prefill_chunk_attention_limit",
                                       f"must be -1 (auto), 0 (no limit) or positive, got {self.prefill_chunk_attention_limit!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(name, f"must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise InvalidArgumentError("max_model_len", f"must be a positive integer, got {self.max_model_len!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 2):
            raise InvalidArgumentError("num_blocks", f"must be >= 2 (block 0 is reserved), got {self.num_blocks!r}")
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise InvalidArgumentError("gpu_memory_fraction", f"must be in (0, 1], got {self.gpu_memory_fraction}")
