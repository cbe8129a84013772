"""Building blocks shared by the model families: RMSNorm, rotary embeddings, paged attention.

Numerics follow Hugging Face's implementations step by step (fp32 norm statistics, cos/sin computed
in fp32 from the same inverse frequencies), so that greedy decoding matches ``generate`` token for
token in fp32. In a 16-bit model the weights, the GEMMs and the KV cache are 16-bit, while the norm
statistics and the rotation run in fp32 and the residual stream stays fp32 (see ``llama.py``): each
16-bit rounding then happens once per sub-layer output, never accumulated across layers. A bf16 model
on the CPU runs RMSNorm (with its residual add) and the rotation through ``paged_kernels.cpu_fused``: the
same arithmetic in one pass each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from paged_kernels import cpu_fused


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or one of its options) is not implemented here."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] in fp32 (the residual stream) or the model dtype -> [T, D] in the model (weight) dtype
        if x.dtype == torch.float32 and cpu_fused.applies(self.weight):
            return cpu_fused.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(self.weight.dtype)

    def add_and_norm(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x + y`` (``x`` the fp32 residual stream, ``y`` a sub-layer's output) and its norm. A bf16
        model on the CPU does both in one pass and updates ``x`` in place; elsewhere ``x`` is left as is."""
        if x.dtype == torch.float32 and y.dtype == self.weight.dtype and cpu_fused.applies(self.weight):
            return x, cpu_fused.rms_norm(x, self.weight, self.eps, residual=y)
        x = x + y
        return x, self(x)


def rope_inv_freq(hf_config: Any, head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32) from ``rope_parameters`` (or the older
    ``rope_theta`` / ``rope_scaling``): the default, ``linear`` and Llama-3 (``llama3``) kinds."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        factor = params["factor"]
        low_factor, high_factor = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low_factor, old_len / high_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (default, linear, llama3 are)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, looked up per packed token."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, Dh]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> Rotation:
        # positions: [T] -> the rotation of those tokens, for every layer of one forward pass. Checked
        # here on the CPU (the C path indexes the tables unchecked); a CUDA index is checked on device.
        if positions.device.type == "cpu" and positions.numel() and (
                int(positions.min()) < 0 or int(positions.max()) >= self.cos.shape[0]):
            raise IndexError(f"positions must lie in [0, {self.cos.shape[0]}) (max_positions)")
        return Rotation(positions.to(torch.int64), self.cos, self.sin)


@dataclass(slots=True)
class Rotation:
    """The rotary embedding of one forward pass's tokens (positions checked against the tables)."""

    positions: torch.Tensor  # [T] int64
    cos_table: torch.Tensor  # [P, Dh] fp32
    sin_table: torch.Tensor  # [P, Dh] fp32
    _picked: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of the tokens: [T, 1, Dh]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H, Dh]`` rotated, in its dtype: bf16 on the CPU in place, in one pass (C);
        otherwise as Hugging Face computes it, into a new tensor."""
        if cpu_fused.applies(x):
            return cpu_fused.rope_(x, self.positions, self.cos_table, self.sin_table, positions_checked=True)
        if self._picked is None:  # gathered once per forward pass, shared by every layer
            self._picked = (self.cos_table[self.positions][:, None, :], self.sin_table[self.positions][:, None, :])
        return apply_rope(x, *self._picked)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, Dh] -> the same shape and dtype, rotated in fp32 (cos/sin are fp32; a no-op cast in
    # an fp32 model); rotate_half pairs dimension i with i + Dh/2 (the Hugging Face layout)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache (built once per step by the runner)."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32: block ids of each scheduled sequence
    query_start_loc: torch.Tensor  # [S + 1] int32: sequence s owns tokens [qsl[s], qsl[s+1])
    seq_lens: torch.Tensor  # [S] int32: context length including this step's tokens
    max_query_len: int
    max_seq_len: int
    # The attention op's memo for this step (``step_cache``): what it derives from the fields above,
    # made by the first layer's call and read by the others.
    step_cache: dict = field(default_factory=dict)


ReshapeAndCache = Callable[..., None]
PagedAttentionOp = Callable[..., torch.Tensor]


@dataclass(slots=True)
class ForwardContext:
    """Everything a forward pass needs besides the tokens, passed explicitly (no module globals)."""

    metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [num_blocks, block_size, KVH, Dh]
    reshape_and_cache: ReshapeAndCache
    paged_attention: PagedAttentionOp

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [T, H, Dh], k/v: [T, KVH, Dh] -> [T, H, Dh]; new K/V are stored before attention reads them.
        # Rows past the step's tokens (a model's padding to a GEMM bucket) are dead: they neither
        # write the cache nor attend, and their output rows are zeros.
        key_cache, value_cache = self.kv_caches[layer]
        m = self.metadata
        n = m.slot_mapping.shape[0]
        out = None
        if q.shape[0] != n:
            out = torch.empty_like(q)
            out[n:].zero_()
            q, k, v = q[:n], k[:n], v[:n]
        self.reshape_and_cache(k, v, key_cache, value_cache, m.slot_mapping)
        attended = self.paged_attention(
            q, key_cache, value_cache, m.block_tables, m.query_start_loc, m.seq_lens, scale,
            None if out is None else out[:n], max_query_len=m.max_query_len, step_cache=m.step_cache,
        )
        return attended if out is None else out
