"""Llama (and the families shaped like it) over packed tokens and a paged KV cache.

Tokens of all scheduled sequences are packed flat (``[T]``, no padding); attention finds each
sequence's context through the block table in :class:`ForwardContext`. Q/K/V and gate/up
projections are fused into one matmul each (fewer, larger GEMMs); the Hugging Face weights are
concatenated at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from paged_kernels import cpu_fused
from worker_service.models.cpu_gemm import PackedLinear
from worker_service.models.layers import (
    ForwardContext,
    RMSNorm,
    RotaryEmbedding,
    Rotation,
    UnsupportedModelError,
    rope_inv_freq,
)

# Per sampling row, the largest 16-bit logits recomputed in fp32 (see LlamaForCausalLM.compute_logits):
# ties rounded together by a bf16 output are within a few of the top.
REFINED_LOGITS = 8


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    inv_freq: torch.Tensor  # [head_dim // 2] fp32

    @classmethod
    def from_hf(cls, c: Any, *, qkv_bias: bool | None = None) -> DecoderConfig:
        if getattr(c, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {c.hidden_act!r} is not supported (silu is)")
        if getattr(c, "mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(c, "attention_bias", False)) if qkv_bias is None else qkv_bias,
            inv_freq=rope_inv_freq(c, head_dim),
        )


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, rotate: Rotation, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]  # x: [T, D]
        qk, v = self.qkv(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads side by side, rotated by one call: [T, H + KVH, Dh]
        qk = rotate(qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, Dh], [T, KVH, Dh]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, KVH, Dh]
        out = ctx.attend(self.layer, q, k, v, self.scale)  # [T, H, Dh]
        return self.o(out.reshape(T, self.q_size))  # [T, D]


class MLP(nn.Module):
    SILU_MUL_OF = "gate_up"  # the linear whose output (gate, then up) SiLU * up takes (cpu_gemm.prepack)

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, D]
        if isinstance(self.gate_up, PackedLinear):  # bf16 on the CPU: SiLU * up in the GEMM's pass where it can
            fused = self.gate_up.silu_mul(x)
            if fused is not None:
                return self.down(fused)
        gate_up = self.gate_up(x)  # [T, 2I]
        if cpu_fused.applies(gate_up):  # bf16 on the CPU: one pass, rounded as the torch code rounds
            return self.down(cpu_fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, rotate: Rotation,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, D] fp32, the residual stream; pending: the layer before's MLP output [T, D] (model
        # dtype), not yet added to x (None in the first layer): added here with the input norm, in one
        # pass. Returns the stream and this layer's MLP output, pending in turn.
        x, h = (x, self.input_norm(x)) if pending is None else self.input_norm.add_and_norm(x, pending)
        x, h = self.post_attn_norm.add_and_norm(x, self.attn(h, rotate, ctx))
        return x, self.mlp(h)


class LlamaForCausalLM(nn.Module):
    """Llama: RMSNorm, RoPE, GQA, SwiGLU; tied or untied embeddings."""

    def __init__(self, cfg: DecoderConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.inv_freq, max_positions)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # The LM-head GEMM with its weight laid out for the CPU's GEMM (cpu_gemm.prepack), or None:
        # F.linear on the weight above. The weight itself stays (embedding, the fp32 refinement).
        self.head_gemm: nn.Module | None = None
        # Rows a forward pass and the LM head compute, for the real ones (cpu_gemm.padded_rows: few
        # GEMM shapes), or None: exactly the real ones. Padding rows are dead tokens: attention and
        # the KV cache see only the real ones.
        self.pad_rows: Callable[[int], int] | None = None

    def _padded(self, rows: int) -> int:
        """The rows a GEMM of ``rows`` real ones computes (see ``pad_rows``)."""
        return rows if self.pad_rows is None else self.pad_rows(rows)

    @classmethod
    def config_from_hf(cls, hf_config: Any) -> DecoderConfig:
        return DecoderConfig.from_hf(hf_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, D] in the model dtype (before the LM head)
        num_tokens = input_ids.shape[0]
        padded = self._padded(num_tokens)
        if padded != num_tokens:  # dead tokens up to the bucket: token 0 at position 0
            input_ids, positions = F.pad(input_ids, (0, padded - num_tokens)), F.pad(positions, (0, padded - num_tokens))
        x = self.embed(input_ids).float()  # [T, D]: the residual stream is fp32 whatever the model dtype
        rotate = self.rope(positions)
        pending = None
        for layer in self.layers:
            x, pending = layer(x, pending, rotate, ctx)
        if pending is None:  # a model of no layers
            return self.norm(x[:num_tokens])
        return self.norm.add_and_norm(x[:num_tokens], pending[:num_tokens])[1]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[N, V]`` fp32 of ``hidden`` ``[N, D]`` (only the rows that sample).

        The GEMM runs in the model dtype. A 16-bit GEMM accumulates in fp32 but returns its output
        rounded to 16 bits — for bf16, steps of 1/16 at a logit of 10, so near-ties become exact
        ties and greedy picks the lower token id. The :data:`REFINED_LOGITS` largest logits of each
        row, the only ones greedy decoding and the head of a sampled distribution depend on, are
        therefore recomputed in fp32 from the same 16-bit operands (a ``[N, k, D]`` product, not a
        second ``[N, V]`` GEMM). In an fp32 model the GEMM's output is used as is. A bf16 model on
        the CPU does the widening, the selection and the products in one C pass per row
        (``cpu_fused.refine_logits``: ties at the k-th value go to the lower token id), into ``out``
        when given (fp32, at least ``N`` rows of ``V``: the runner's buffer, reused every step; the
        result is then a view of it).
        """
        weight = self._head_weight()
        logits = self._head(hidden, weight)  # [N, V]
        if logits.shape[0] > 0 and cpu_fused.applies(logits):  # bf16 on the CPU: the same in one pass (C)
            return cpu_fused.refine_logits(logits, hidden.contiguous(), weight, REFINED_LOGITS,
                                           None if out is None else out[:logits.shape[0]])
        logits = logits.float()
        if weight.dtype != torch.float32 and logits.shape[0] > 0:
            top = logits.topk(min(REFINED_LOGITS, logits.shape[1]), dim=-1).indices  # [N, k]
            exact = torch.einsum("nd,nkd->nk", hidden.float(), weight[top].float())  # [N, k]
            logits.scatter_(1, top, exact)
        return logits

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The greedy token of each row of ``hidden`` ``[N, D]`` (int64 ``[N]``): the first index of
        the largest of :meth:`compute_logits`' values, the same tokens as the sampler's greedy pick
        from them, without making the fp32 ``[N, V]`` logits (a bf16 model on the CPU:
        ``cpu_fused.greedy_refined``, the LM-head GEMM then the selection alone). None where this
        path does not run (another dtype or device, no C library, a NaN in a row): compute the
        logits and sample them."""
        weight = self._head_weight()
        if not hidden.shape[0] or not cpu_fused.applies(weight):
            return None
        return cpu_fused.greedy_refined(self._head(hidden, weight), hidden.contiguous(), weight, REFINED_LOGITS)

    def _head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def _head(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The LM-head GEMM's output ``[N, V]`` in the model dtype (its rows padded as the forward
        pass's); ``weight``: :meth:`_head_weight`, for the plain path."""
        rows = hidden.shape[0]
        padded = self._padded(rows)
        head_input = hidden if padded == rows else F.pad(hidden, (0, 0, 0, padded - rows))
        return (F.linear(head_input, weight) if self.head_gemm is None else self.head_gemm(head_input))[:rows]

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face ``LlamaForCausalLM``-style state dict in, fusing q/k/v and gate/up.

        Every parameter must be filled and every checkpoint tensor used (a leftover one means a
        variant this file does not implement), else :class:`UnsupportedModelError`.
        """
        state = dict(state)
        missing: list[str] = []

        def take(name: str) -> torch.Tensor | None:
            t = state.pop(name, None)
            if t is None:
                missing.append(name)
            return t

        def put(param: torch.Tensor, *names: str) -> None:
            parts = [take(n) for n in names]
            if any(p is None for p in parts):
                return
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if value.shape != param.shape:
                raise UnsupportedModelError(f"{names[0]}: shape {tuple(value.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(value)

        put(self.embed.weight, "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(layer.input_norm.weight, p + "input_layernorm.weight")
            put(layer.post_attn_norm.weight, p + "post_attention_layernorm.weight")
            qkv = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
            put(layer.attn.qkv.weight, *qkv)
            if layer.attn.qkv.bias is not None:
                put(layer.attn.qkv.bias, *[n.replace(".weight", ".bias") for n in qkv])
            put(layer.attn.o.weight, p + "self_attn.o_proj.weight")
            put(layer.mlp.gate_up.weight, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            put(layer.mlp.down.weight, p + "mlp.down_proj.weight")
        put(self.norm.weight, "model.norm.weight")
        if self.lm_head is not None:
            put(self.lm_head.weight, "lm_head.weight")
        else:
            state.pop("lm_head.weight", None)  # tied: the same tensor as the embedding
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        if missing or state:
            raise UnsupportedModelError(
                f"checkpoint does not match {type(self).__name__}: "
                f"missing {missing[:5]}, unexpected {sorted(state)[:5]}"
            )
