"""The multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5 checkpoints (``mtp.*`` weights), and the paged
cache of the target's hidden states it reads.

The head predicts the token after next: at position p it takes the embedding of token p + 1 and the target's final
(normed) hidden state at p, each through its own zero-centred RMSNorm, concatenated (embedding first) and projected
by ``fc`` from 2H to H, then one gated-attention decoder layer (the target's layer kind, MoE included) and a final
norm; the target's lm_head gives its logits. Drafting k tokens runs it k times, each later step taking the head's
own output in place of the target's hidden state (pipeline/spec/mtp.py).

The head's attention has its own paged K/V cache, and the target writes every position's hidden state into a paged
cache too, both in the target's blocks: the KV tiers, prefix caching and preemption move them with the blocks.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from pipeline.dist.group import ExpertShard
from pipeline.models.config import ModelArchConfig
from pipeline.models.decoder_layer import DecoderLayer
from pipeline.models.forward_context import ForwardContext, PagedKVSpec
from pipeline.models.gated_attention import gated_attention_layer
from pipeline.models.layers import Linear, RMSNorm
from pipeline.models.moe_layout import layer_mlp


def hidden_cache_spec(hidden_size: int, dtype: torch.dtype) -> PagedKVSpec:
    """The target's hidden state per position as a paged cache: its two halves in the K and V planes, so the
    block copies of the KV tiers move it like any attention layer's cache."""
    return PagedKVSpec(1, hidden_size // 2, dtype)


def write_hidden(cache: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor) -> None:
    """Store each row's hidden state at its slot (padding rows, slot -1, go to the null block 0, never read)."""
    half = cache.shape[-1]
    flat = cache.view(2, -1, half)
    index = slots.clamp(min=0)
    flat[0].index_copy_(0, index, hidden[:, :half].to(cache.dtype))
    flat[1].index_copy_(0, index, hidden[:, half:].to(cache.dtype))


def read_hidden(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The hidden states stored at ``slots`` ([T, H]; padding rows' slot -1 reads the null block)."""
    flat = cache.view(2, -1, cache.shape[-1])
    index = slots.clamp(min=0)
    return torch.cat([flat[0].index_select(0, index), flat[1].index_select(0, index)], dim=-1)


def mtp_arch(arch: ModelArchConfig) -> ModelArchConfig:
    """The head's decoder layer as a one-layer model: gated full attention, the MLP sparse when the target has
    experts (the head has no dense-only layers of its own), all of them: under expert parallelism the head drafts
    on rank 0 alone."""
    return replace(arch, num_layers=1, layer_types=("full_attention",), mlp_only_layers=(), decoder_sparse_step=1,
                   expert_shard=ExpertShard())


class MultiTokenPredictor(nn.Module):
    """``forward(embeds [T, H], hidden [T, H], ctx) -> hidden [T, H]`` (final norm applied); its attention reads
    ``ctx.caches[0]``."""

    def __init__(self, arch: ModelArchConfig, dtype=None, device=None) -> None:
        super().__init__()
        size, eps, zero = arch.hidden_size, arch.rms_norm_eps, arch.zero_centered_norm
        self.pre_fc_norm_embedding = RMSNorm(size, eps, dtype, device, zero)
        self.pre_fc_norm_hidden = RMSNorm(size, eps, dtype, device, zero)
        self.fc = Linear(2 * size, size, False, dtype, device)
        head = mtp_arch(arch)
        self.layers = nn.ModuleList([DecoderLayer(head, "self_attn", gated_attention_layer(head, 0, dtype, device),
                                                  layer_mlp(head, 0, dtype, device), dtype, device)])
        self.norm = RMSNorm(size, eps, dtype, device, zero)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[0](x, None, ctx)
        x, _ = self.norm(x, residual)
        return x

