"""Attention over the paged KV cache: the layer every attending decoder layer has (``PagedAttention``), the dense
families' configuration of it (``attention_layer``), and what all attention layers of one forward share
(``fill_attention_context``: the rope of the positions and the attention plan, computed once)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from kernels import dispatch
from kernels.dispatch import MAX_DECODE_ROW_TOKENS, decode_rows_on, use_triton
from kernels.kv_cache import write_kv_ref
from kernels.paged_attention import paged_attention_ref, plan_paged_attention
from kernels.triton_decode_attention import decode_rows
from kernels.triton_paged_attention import TritonAttentionPlan, paged_attention_triton
from pipeline.models.config import ModelArchConfig
from pipeline.models.forward_context import ForwardContext
from pipeline.models.layers import Linear, MergedLinear, RMSNorm
from pipeline.models.rope import RotaryEmbedding, apply_rotary_emb_

# the HF projections PagedAttention loads as shards of its fused one: HF name piece -> (fused piece, shard index)
ATTENTION_FUSED_NAMES = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
}


def fill_attention_context(rotary: RotaryEmbedding, positions: torch.Tensor, ctx: ForwardContext) -> None:
    """What every attention layer reads from ``ctx`` and is computed once a forward: the rope of the positions and
    the attention plan (the Triton path's launch choices, or the torch reference's gather indices / masks)."""
    ctx.rope = rotary.step_rope(positions)
    if not use_triton(positions.device):
        ctx.attention_plan = plan_paged_attention(ctx.attention, ctx.kv_cache(0).shape[2])
        return
    meta, plan = ctx.attention, ctx.attention.kernel_plan
    if (isinstance(plan, TritonAttentionPlan) and decode_rows_on() and not meta.is_decode_only
            and meta.max_query_len <= MAX_DECODE_ROW_TOKENS):  # verify rows: each token as a decode row
        plan = replace(plan, decode_rows=decode_rows(meta, positions.shape[0]))
    ctx.attention_plan = plan


def attention_layer(arch: ModelArchConfig, cache_index: int, dtype=None, device=None) -> PagedAttention:
    """The dense families' attention (Llama, Mistral, Qwen2, Qwen3): q/k/v and o_proj biases and q/k norms as the
    config says, no output gate."""
    return PagedAttention(
        cache_index,
        arch.hidden_size,
        arch.num_heads,
        arch.num_kv_heads,
        arch.head_dim,
        qkv_bias=arch.attention_bias,
        o_bias=arch.o_proj_bias,
        qk_norm=arch.qk_norm,
        rms_norm_eps=arch.rms_norm_eps,
        is_neox_style=not arch.rope_interleaved,
        dtype=dtype,
        device=device,
    )


class PagedAttention(nn.Module):
    """Fused qkv projection (+bias), optional per-head q/k RMSNorm, rope, KV write, paged attention, o_proj.

    ``cache_index`` is this layer's place among the model's attention layers: which of ``ctx.caches`` is
    its paged K/V cache (the model's ``cache_specs()`` declares them in that order)."""

    def __init__(
        self,
        cache_index: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        rms_norm_eps: float = 1e-6,
        is_neox_style: bool = True,
        output_gate: bool = False,
        zero_centered_qk_norm: bool = False,
        dtype=None,
        device=None,
    ) -> None:
        super().__init__()
        self.cache_index = cache_index
        self.output_gate = output_gate
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.is_neox_style = is_neox_style
        # with an output gate (Qwen3-Next / Qwen3.5), a fourth shard holds the gate: o_proj(attn * sigmoid(gate))
        shards = [self.q_size, self.kv_size, self.kv_size] + ([self.q_size] if output_gate else [])
        self.qkv_proj = MergedLinear(hidden_size, shards, qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, hidden_size, o_bias, dtype, device)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_norm_eps, dtype, device, zero_centered_qk_norm)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps, dtype, device, zero_centered_qk_norm)
        else:
            self.q_norm = self.k_norm = None
        # an fp8 KV cache holds K / k_scale and V / v_scale (the checkpoint's k_scale / v_scale, else 1)
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def input_proj(self) -> MergedLinear:
        return self.qkv_proj

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Reads the step's rope (cos/sin [T, 1, rotary_dim]) and attention plan
        from ``ctx``, which the model filled once for all layers, and writes this step's K/V into its cache."""
        return self.forward_projected(self.qkv_proj(x), ctx)

    def forward_projected(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``forward`` from the fused qkv projection on."""
        kv_cache = ctx.kv_cache(self.cache_index)  # [2, NB, BS, KVH, D]
        meta, plan = ctx.attention, ctx.attention_plan
        rope = ctx.rope
        T = qkv.shape[0]
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        qk_end = self.q_size + self.kv_size
        v_end = qk_end + self.kv_size
        gpu = dispatch.use_triton(qkv.device)
        if gpu:  # norms, rope and the KV write in one kernel
            q = qkv[:, : self.q_size].view(T, H, D)
            k = qkv[:, self.q_size : qk_end].view(T, KVH, D)
            v = qkv[:, qk_end:v_end].view(T, KVH, D)
            norms = (None, None, 0.0) if self.q_norm is None else (
                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            dispatch.qkv_prologue(q, k, v, *norms, rope.cos_table, rope.sin_table, self.is_neox_style, kv_cache,
                                  meta.slot_mapping, rows=rope.positions, k_scale=self.k_scale, v_scale=self.v_scale)
            gate = qkv[:, v_end:].view(T, H, D) if self.output_gate else None
            out = paged_attention_triton(q, kv_cache, meta, self.scale, plan, gate, self.k_scale, self.v_scale)
            return self.o_proj(out.reshape(T, self.q_size))
        rotate = _rotate_ref
        cos, sin = rope.gathered()
        if self.q_norm is None:
            # q and k are adjacent: one in-place rotation covers both.
            qk = qkv[:, :qk_end].view(T, H + KVH, D)
            rotate(qk, None, cos, sin, self.is_neox_style)
            q, k = qk[:, :H], qk[:, H:]
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(T, H, D))
            k = self.k_norm(qkv[:, self.q_size : qk_end].view(T, KVH, D))
            rotate(q, k, cos, sin, self.is_neox_style)
        v = qkv[:, qk_end:v_end].view(T, KVH, D)
        write_kv_ref(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = paged_attention_ref(q, kv_cache, meta, self.scale, plan, self.k_scale, self.v_scale)
        return self.o_proj(self._gated(out.reshape(T, self.q_size), qkv, v_end))

    def _gated(self, out: torch.Tensor, qkv: torch.Tensor, v_end: int) -> torch.Tensor:
        """attn * sigmoid(gate) in the activation dtype (as transformers multiplies), when the layer has a gate."""
        if not self.output_gate:
            return out
        return out * torch.sigmoid(qkv[:, v_end:])


def _rotate_ref(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                is_neox_style: bool) -> None:
    apply_rotary_emb_(q, cos, sin, is_neox_style)
    if k is not None:
        apply_rotary_emb_(k, cos, sin, is_neox_style)
