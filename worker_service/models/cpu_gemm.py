"""Linear weights laid out once, at load, for oneDNN's CPU GEMM (bf16).

``F.linear`` on a bf16 CPU tensor hands oneDNN a plain ``[out, in]`` weight and oneDNN reorders it
into its blocked layout on every call; for the small batches of decode steps that reorder is a
large part of the call. :func:`prepack` reorders each decoder-layer linear and the LM head once
(``torch.ops.mkldnn._reorder_linear_weight``, what torch.compile's CPU freezing pass does) and runs
it with ``torch.ops.mkldnn._linear_pointwise``. Measured on a 2-core AVX512-BF16 host, the four
linears of a SmolLM2-135M layer: 1,273 → 1,102 µs at 64 rows, 227 → 128 µs at 1 row, 35.8 → 33.2 ms
at 2,048 rows; the LM head (49,152 x 576) 13.2 → 9.3 ms at 64 rows; outputs bit-identical to
``F.linear``.

With ``small``, each decoder-layer weight gets a second layout too, for the AMX tile kernel of
``paged_kernels.small_gemm`` (steps of up to ~1,000 rows: decode steps, where oneDNN's calls cost
more than their memory traffic, and short prefills, where it runs below the tiles' rate): not
bit-identical to oneDNN (fp32 sums in another order), but each row's result independent of the
batch. Larger steps keep oneDNN.

Only bf16 is packed: in fp32 oneDNN's GEMM rounds differently from the MKL one ``F.linear`` uses,
and fp32 is the mode that keeps exact parity with transformers. The LM head's plain weight stays
(the embedding and the logits' fp32 refinement read it): its packed copy costs one more copy of it.
Packing checks itself on the first layer and keeps ``F.linear`` when the ops are missing or their
result differs.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from paged_kernels import small_gemm

log = logging.getLogger(__name__)

_OPS = ("_reorder_linear_weight", "_linear_pointwise")


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a weight in oneDNN's blocked layout (inference only); with
    ``small``, also in ``paged_kernels.small_gemm``'s, which takes the calls of up to ``small_rows``
    rows. With ``silu_mul`` too (a fused gate/up projection: gate rows, then up rows, no bias), the
    tile layout is the gate/up one and :meth:`silu_mul` computes SiLU(gate) * up on the tiles in the
    same pass; :meth:`forward` then runs on oneDNN at every row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, small: bool = False,
                 silu_mul: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        # the layout of paged_kernels.small_gemm (steps of up to small_rows rows), or None: oneDNN alone
        tiles = small and small_gemm.packable(weight) and (bias is None or bias.dtype == torch.bfloat16)
        self.fused_silu_mul = tiles and silu_mul and bias is None and self.out_features % (2 * small_gemm.GROUP) == 0
        layout = small_gemm.pack_gate_up if self.fused_silu_mul else small_gemm.pack
        self.register_buffer("small_weight", layout(weight.detach()) if tiles else None, persistent=False)
        self.small_rows = small_gemm.max_rows(self.out_features) if tiles else 0
        self._forward_rows = 0 if self.fused_silu_mul else self.small_rows  # the rows forward() runs on the tiles

    @classmethod
    def of(cls, linear: nn.Linear, small: bool = False, silu_mul: bool = False) -> PackedLinear:
        return cls(linear.weight, linear.bias, small, silu_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if 0 < x.shape[0] <= self._forward_rows:
            return small_gemm.linear(x, self.small_weight, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` ``[T, out / 2]`` of this gate/up projection of ``x`` ``[T, in]``, in one
        pass on the tiles (the same bits as ``cpu_fused.silu_mul(self(x))`` would give with the
        tiles' plain layout); None where this layer cannot (no gate/up layout, or too many rows)."""
        if self.fused_silu_mul and 0 < x.shape[0] <= self.small_rows:
            return small_gemm.silu_mul_linear(x, self.small_weight, self.out_features // 2)
        return None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"small_gemm={self.small_weight is not None}, fused_silu_mul={self.fused_silu_mul}")


# oneDNN (through ideep) keeps a compiled primitive per GEMM shape it meets, up to 1,024 of them
# (torch's LRU_CACHE_CAPACITY), each holding buffers that grow with its row count, and a step's row
# count (its tokens, or the rows that sample) takes nearly any value up to the token budget. Measured
# here (2 threads, bf16): one 3,072 x 576 weight met at every row count 1..2,048 took 4.1 GiB, and
# 8.8 GiB more on a second pass (the evicted entries' memory is not returned); a worker serving
# random batches grew ~40 MiB a minute. A model whose weights are packed therefore pads the rows of
# its forward pass (and of its LM head) up to a bucket: a multiple of 8 up to 128 rows, beyond that
# an eighth of the power of two below (at most 12.5 % more rows), so each weight meets at most 48
# shapes (a Llama layer's and the LM head's: ~300 MiB once, then flat). The padding is done once a
# step, at the model's entrance, not per GEMM.
SMALL_ROWS, SMALL_BUCKET = 128, 8

def padded_rows(rows: int) -> int:
    """``rows`` rounded up to its bucket (0 stays 0)."""
    bucket = SMALL_BUCKET if rows <= SMALL_ROWS else (1 << (rows.bit_length() - 1)) // 8
    return -(-rows // bucket) * bucket


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of ``dtype`` on ``device`` can be packed here: this torch build has the ops
    and this CPU runs them (oneDNN's bf16 path wants AVX-512 or AVX-NE-CONVERT: an AVX2-only CPU
    has the ops but no kernel)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _runs_here()


@functools.cache
def _runs_here() -> bool:
    if not (torch.backends.mkldnn.is_available() and all(hasattr(torch.ops.mkldnn, op) for op in _OPS)):
        return False
    probe = nn.Linear(32, 16, bias=False).to(torch.bfloat16)
    try:
        return _agrees(probe, PackedLinear.of(probe))
    except RuntimeError as exc:  # an op without a kernel for this CPU
        log.info("oneDNN's packed bf16 GEMM does not run on this CPU (%s)", exc)
        return False


def _agrees(linear: nn.Linear, packed: PackedLinear) -> bool:
    x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
    with torch.inference_mode():
        return torch.equal(packed(x), nn.functional.linear(x, linear.weight, linear.bias))


def prepack(model: nn.Module, small: bool = False) -> int:
    """Lay out ``model``'s GEMM weights for oneDNN: every ``nn.Linear`` of its decoder layers
    (``model.layers``) becomes a :class:`PackedLinear`, the LM head (tied or not) gets a packed
    copy as ``model.head_gemm``, and the model pads its rows (``model.pad_rows``, see
    :func:`padded_rows`). ``small``: the decoder layers' weights get the small-batch kernel's layout
    too, where it runs (``paged_kernels.small_gemm.available``). Returns how many weights were
    packed (0: the model is as it was)."""
    num_packed = prepack_linears(model.layers, small)
    if num_packed:
        head = model.embed.weight if model.lm_head is None else model.lm_head.weight
        model.head_gemm = PackedLinear(head)  # a copy: the plain weight stays
        model.pad_rows = padded_rows
        num_packed += 1
    return num_packed


def prepack_linears(layers: nn.Module, small: bool = False) -> int:
    """Replace every ``nn.Linear`` under ``layers`` (the decoder layers) with a :class:`PackedLinear`
    (``small``: with the small-batch kernel's layout too, where it runs; the linear a module names
    in its ``SILU_MUL_OF`` attribute, the input of its SiLU * up, with the gate/up layout); returns
    how many were packed (0: kept as they were)."""
    targets = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    if not targets:
        return 0
    first_parent, first_name, first = targets[0]
    if not supported(first.weight.dtype, first.weight.device):
        return 0
    try:
        packed_first = PackedLinear.of(first)
        if not _agrees(first, packed_first):
            log.warning("oneDNN's packed GEMM differs from F.linear in this torch build: weights left unpacked")
            return 0
    except RuntimeError as exc:  # an op missing a kernel for this CPU or dtype
        log.warning("cannot pack linear weights for oneDNN (%s): weights left unpacked", exc)
        return 0
    small = small and small_gemm.available() and _copy_fits(sum(t[2].weight.nbytes for t in targets))
    if small:
        packed_first = PackedLinear.of(first, small, _takes_silu_mul(first_parent, first_name))
    setattr(first_parent, first_name, packed_first)  # the checked one
    for parent, name, linear in targets[1:]:
        setattr(parent, name, PackedLinear.of(linear, small, _takes_silu_mul(parent, name)))
    return len(targets)


def _takes_silu_mul(parent: nn.Module, name: str) -> bool:
    """Whether ``parent``'s linear ``name`` is the one its SiLU * up takes (its ``SILU_MUL_OF``)."""
    return name == getattr(parent, "SILU_MUL_OF", None)


# The tile kernel's copy of the layers' weights is made only while it takes at most this share of the
# memory the system has available: the default model's 0.2 GiB always, a 7B model's 13 GiB not on a
# 24 GiB host (it then keeps oneDNN alone, with a line in the log).
SMALL_GEMM_MEMORY_SHARE = 0.25


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _copy_fits(nbytes: int) -> bool:
    available = _available_bytes()
    if available is None or nbytes <= SMALL_GEMM_MEMORY_SHARE * available:
        return True
    log.warning("the AMX tile GEMM's copy of the layers' weights (%.1f GiB) would take more than %d%% of the "
                "memory available (%.1f GiB): the layers keep oneDNN alone", nbytes / 2**30,
                round(100 * SMALL_GEMM_MEMORY_SHARE), available / 2**30)
    return False


def small_gemm_layers(model: nn.Module) -> int:
    """How many of ``model``'s linears run small batches on ``paged_kernels.small_gemm``."""
    return sum(1 for m in model.modules() if isinstance(m, PackedLinear) and m.small_weight is not None)
