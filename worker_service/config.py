"""A worker's settings: what its model runner loads and how big its KV cache and batch are
(:class:`ModelRunnerConfig`, which the in-process ``LLM`` takes too), and the worker service around
it (:class:`WorkerConfig`). Frozen, range-checked by each field's declaration."""

from __future__ import annotations

import re
import socket
import uuid
from dataclasses import dataclass, field

from paged_kernels import BACKENDS as ATTENTION_BACKENDS
from servicekit import redis_client
from servicekit.contract.errors import InvalidArgumentError
from servicekit.contract.scheduling import BatchLimits
from servicekit.contract.settings import check_settings, setting
from servicekit.contract.step import MAX_DRAFT_TOKENS
from servicekit.model_registry import ModelConfig
from servicekit.ports import WORKER_PORT
from servicekit.redis_client import RedisConfig
from servicekit.service_config import PORT_RANGE, MetricsConfig, ServerConfig
from servicekit.tls import InternalLinkConfig
from worker_service.loader import AUTO_DTYPE_RULE, auto_dtype_here
from worker_service.simulated_runner import parse_step_latency

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


@dataclass(frozen=True, kw_only=True)
class ModelRunnerConfig(ModelConfig, BatchLimits):
    """What a worker needs to load a model and size its KV cache and persistent batch.

    KV-cache size, first match wins: ``num_blocks`` (exact, incl. the null block) →
    ``kv_cache_memory`` (bytes) → on CUDA the memory free after loading the weights minus a headroom
    of ``1 - gpu_memory_fraction`` of the device's total memory and an activation reserve
    (``worker_service.kv_cache.cuda_kv_budget``) → on CPU ``DEFAULT_CPU_KV_CACHE_MEMORY``. Never more blocks than ``max_num_seqs``
    full-length sequences can use. The batch limits (``max_num_seqs``, ``max_num_batched_tokens``,
    ``prefill_chunk_attention_limit``) are :class:`BatchLimits`, shared with the scheduler.
    """

    dtype: str = setting("auto", choices=DTYPES,
                         help=f"weights, activations and KV-cache dtype; {AUTO_DTYPE_RULE}", host_note=auto_dtype_here)
    device: str | None = setting(None, type=str, help="torch device (default: cuda if available, else cpu)")
    block_size: int = setting(16, minimum=1, help="tokens per KV-cache block")
    max_model_len: int | None = setting(None, type=int, minimum=1,
                                        help="prompt + output tokens at most (default: the model's "
                                             "max_position_embeddings)")
    kv_cache_memory: str | int | None = setting(
        None, type=str, help="KV-cache budget such as 2GiB (default: from free GPU memory, 1GiB on CPU)")
    gpu_memory_fraction: float = setting(
        0.9, above=0, maximum=1, help="share of the GPU's total memory this worker may hold; the rest stays free as headroom")
    num_blocks: int | None = setting(None, type=int, minimum=2, help="exact KV blocks incl. the null block (default: from "
                                                          "memory)")
    attention_backend: str = setting("auto", choices=ATTENTION_BACKENDS, help="paged-attention implementation: " + "; ".join(
        f"{name} = {what}" for name, what in ATTENTION_BACKENDS.items()))
    # CPU tuning (no effect on CUDA)
    native_kernels: bool = setting(True, help="build and use the C attention kernel (paged_kernels/csrc/) where a "
                                              "C compiler is present")
    kernel_cache: str = setting("", help="where built C kernels are cached (default: ~/.cache/pagedserve/kernels)")
    prepack_weights: bool = setting(True, help="lay bf16 linear weights out once for oneDNN's GEMM (bit-identical "
                                                "outputs; faster small batches)")
    small_gemm: bool = setting(True, help="with --prepack-weights, on a CPU with AMX: the layers' bf16 GEMMs of steps "
                                          "of up to 1,024 rows (decode steps, short prefills) on AMX tiles over a "
                                          "second copy of their weights (paged_kernels/small_gemm.py; made only while it "
                                          "takes at most a quarter of the memory available): each row's result "
                                          "independent of the batch, summed in another order than oneDNN's")
    tune_malloc: bool = setting(True, help="raise glibc's malloc thresholds so per-step activations reuse warm "
                                           "memory; a worker process also keeps every thread on one heap "
                                           "(process-wide)")
    # n-gram speculation (worker_service/ngram.py): the worker proposes, the scheduler schedules
    num_speculative_tokens: int = setting(
        3, minimum=0, maximum=MAX_DRAFT_TOKENS,
        help="draft tokens proposed per decoding request and step by prompt lookup (n-gram speculation: the "
             "tokens that followed the latest earlier occurrence of its last tokens), verified in its next "
             "step; outputs are what one-token steps give (fp32: bit for bit; bf16: within its usual batch "
             "variance), a wrong guess costs compute only (0: off)")
    prompt_lookup_min: int = setting(2, minimum=1, maximum=16, help="shortest suffix n-gram prompt lookup matches")
    prompt_lookup_max: int = setting(3, minimum=1, maximum=16,
                                     help="longest suffix n-gram prompt lookup matches (the longest that occurred "
                                          "before wins)")

    DEFAULT_CPU_KV_CACHE_MEMORY = "1GiB"

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidArgumentError("prompt_lookup_min", f"must be <= prompt_lookup_max ({self.prompt_lookup_max}), "
                                                            f"got {self.prompt_lookup_min}")


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(ServerConfig, MetricsConfig, RedisConfig, InternalLinkConfig):
    """Every knob of a worker (the model runner's in ``runner``); each field is also a flag and an
    env var. With a Redis URL (or Sentinels) the worker registers itself; without, it does not."""

    runner: ModelRunnerConfig = field(default_factory=ModelRunnerConfig)  # what to load, KV cache, batch
    port: int = setting(WORKER_PORT, **PORT_RANGE, help="port to listen on (0 = any free port)")
    advertise_address: str = setting("", help="host:port schedulers should dial (default: derived from "
                                              "--host/--port)")
    worker_id: str = setting(default_factory=lambda: uuid.uuid4().hex[:12], help="registry id")
    heartbeat_ttl_s: float = setting(10.0, minimum=1, help="registry entry lifetime in seconds; refreshed every "
                                                           "third of it")
    bind_cpu_threads: bool = setting(True, help="CPU worker using every allowed CPU: pin the forward pass's OpenMP "
                                                "threads one per CPU and the gRPC/event-loop threads to the last "
                                                "one's CPU, never the runner thread's (worker_service/cpu_affinity.py)")
    step_delay_s: float = setting(0.0, minimum=0, help="testing only: sleep this long after every step (throttles "
                                                       "generation so chaos tests can kill processes mid-generation)")
    # SIMULATION (benchmarks/scale.py only): (a, b) replaces the model by a sleep of a + b x tokens.
    simulate_step_latency: tuple[float, float] | None = setting(
        None, type=parse_step_latency, help="SIMULATION for control-plane benchmarks only: 'a,b' runs no model; each "
                                            "step sleeps a + b x scheduled tokens seconds and returns made-up "
                                            "deterministic tokens (default: off)")

    def __post_init__(self) -> None:
        check_settings(self)
        self.tls.check(server=True)
        if self.tls_cert_file and not self.tls_ca_file:
            raise ValueError("tls_ca_file: a worker with TLS must require client certificates (give the CA that "
                             "signs the schedulers' certificates)")
        redis_client.validate(self)

    def address_for(self, port: int) -> str:
        """The address to advertise once listening on ``port``."""
        if self.advertise_address:
            return self.advertise_address
        host = self.host
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = socket.gethostbyname(socket.gethostname())  # reachable from other containers
        return f"{host}:{port}"
