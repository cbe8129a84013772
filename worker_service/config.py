"""Settings of one model runner (frozen, validated at construction)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kernels import BACKENDS as ATTENTION_BACKENDS
from scheduler_service.core.errors import InvalidParameterError

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
        raise InvalidParameterError(field, f"expected a size such as '2GiB' or a byte count, got {value!r}")
    if unit not in _UNITS:
        raise InvalidParameterError(field, f"unknown unit {unit!r} (use B, KiB, MiB, GiB, KB, MB, GB)")
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise InvalidParameterError(field, f"must be positive, got {value!r}")
    return size


@dataclass(frozen=True, slots=True)
class ModelRunnerConfig:
    """What a worker needs to load a model and size its KV cache and persistent batch.

    KV-cache size, first match wins: ``num_blocks`` (exact, incl. the null block) →
    ``kv_cache_memory`` (bytes) → on CUDA ``gpu_memory_fraction`` of the memory free after loading
    the weights → on CPU ``DEFAULT_CPU_KV_CACHE_MEMORY``. Never more blocks than ``max_num_seqs``
    full-length sequences can use.
    """

    model: str  # short name, HF folder, or .gguf path (pagedserve.model_registry)
    dtype: str = "auto"  # a name of DTYPES; "auto": worker_service.loader.choose_dtype decides
    device: str | None = None  # None = cuda when available, else cpu
    block_size: int = 16
    max_num_seqs: int = 128  # rows of the persistent batch
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    kv_cache_memory: str | int | None = None
    gpu_memory_fraction: float = 0.9
    num_blocks: int | None = None
    attention_backend: str = "auto"  # a name of kernels.BACKENDS

    DEFAULT_CPU_KV_CACHE_MEMORY = "1GiB"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidParameterError("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidParameterError(
                "attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(name, f"must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise InvalidParameterError("max_model_len", f"must be a positive integer, got {self.max_model_len!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 2):
            raise InvalidParameterError("num_blocks", f"must be >= 2 (block 0 is reserved), got {self.num_blocks!r}")
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise InvalidParameterError("gpu_memory_fraction", f"must be in (0, 1], got {self.gpu_memory_fraction}")
