"""The DFlash drafter's model: a few Qwen3 decoder layers that draft a whole block of tokens in one forward,
conditioned on the target's hidden states at chosen layers (z-lab's DFlash, "Block Diffusion for Flash
Speculative Decoding"; an HF directory with ``dflash_config`` in its config.json).

The target's hidden states after layers ``target_layer_ids``, concatenated, go through ``fc`` and ``hidden_norm``
to one context vector per position. Every draft layer attends to that context as extra keys and values: its own
k_proj (then k_norm and rope at the context's position) and v_proj of the context vector, with no input norm. The
block is the last token followed by mask tokens, embedded with the target's table; its queries see every context
position and every block position (no causal mask inside the block), and the target's lm_head reads the drafts
off the block's later positions.

Here the context K/V go into paged caches of the draft layers in the target's blocks, written by the target's own
forwards (``ContextTap``, called with the tapped layers' hidden states): every position the target computes gets
its context K/V once, and the KV tiers, prefix caching and preemption move them with the blocks. A block's own
K/V are written at its positions too, which the target's next forward over them writes over with context.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from kernels import dispatch
from pipeline.models.config import ModelArchConfig
from pipeline.models.decoder_layer import DecoderLayer
from pipeline.models.forward_context import ForwardContext, PagedKVSpec
from pipeline.models.layers import GATED_MLP_FUSED_NAMES, GatedMLP, Linear, MergedLinear, RMSNorm
from pipeline.models.rope import RotaryEmbedding
from pipeline.models.self_attention import ATTENTION_FUSED_NAMES, attention_layer, fill_attention_context
from pipeline.models.weight_loading import load_hf_weights


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    target_layer_ids: tuple[int, ...]  # the target's decoder layers whose outputs form the context
    mask_token_id: int  # the token a block's undrafted positions hold
    block_size: int  # the block it was trained on: at most block_size - 1 drafts a forward


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's choice when a config names none: one layer in the middle, else evenly from layer 1 to
    three before the last."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    return tuple(int(round(first + i * (last - first) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def dflash_config(hf: dict[str, Any], target: ModelArchConfig) -> DFlashConfig:
    """The DFlash fields of a drafter's config.json, checked against its target."""
    extra = hf.get("dflash_config") or {}
    if "mask_token_id" not in extra:
        raise ValueError("a DFlash drafter's config.json needs dflash_config.mask_token_id")
    layers = tuple(int(i) for i in extra.get("target_layer_ids") or
                   default_target_layers(int(hf.get("num_target_layers", target.num_layers)),
                                         int(hf["num_hidden_layers"])))
    if not layers or not all(0 <= i < target.num_layers - 1 for i in layers):
        raise ValueError(f"DFlash target_layer_ids {list(layers)} must be layers 0 .. {target.num_layers - 2} of "
                         f"the target ({target.num_layers} layers)")
    mask = int(extra["mask_token_id"])
    if not 0 <= mask < target.vocab_size:
        raise ValueError(f"DFlash mask_token_id {mask} is outside the target's vocabulary ({target.vocab_size})")
    if int(hf["hidden_size"]) != target.hidden_size:
        raise ValueError(f"the DFlash drafter's hidden size ({hf['hidden_size']}) is not the target's "
                         f"({target.hidden_size})")
    return DFlashConfig(layers, mask, int(hf.get("block_size", 16)))


def dflash_arch(hf: dict[str, Any]) -> ModelArchConfig:
    """The draft layers' shape: Qwen3 layers (q/k norms) whatever model_type the file names. Sliding-window
    layers attend to the whole context here: that changes drafts, never the output."""
    return replace(ModelArchConfig.from_hf(hf), qk_norm=True, sliding_window=None, layer_types=(),
                   zero_centered_norm=False)


class DFlashDraftModel(nn.Module):
    """``forward(block embeddings [T, H], positions [T], ctx) -> hidden [T, H]`` (final norm applied) over the draft
    layers' caches (``ctx.caches``, one per layer); ``write_context`` fills those caches from the target."""

    lm_head = None  # the target's lm_head gives the logits

    def __init__(self, arch: ModelArchConfig, config: DFlashConfig, dtype=None, device=None) -> None:
        super().__init__()
        self.arch, self.config = arch, config
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.layers = nn.ModuleList([
            DecoderLayer(arch, "self_attn", attention_layer(arch, i, dtype, device),
                         GatedMLP.from_arch(arch, dtype, device), dtype, device)
            for i in range(arch.num_layers)])
        self.norm = RMSNorm(size, eps, dtype, device)
        self.fc = Linear(len(config.target_layer_ids) * size, size, False, dtype, device)
        self.hidden_norm = RMSNorm(size, eps, dtype, device)
        self.rotary_emb = RotaryEmbedding.from_arch(arch, dtype=dtype, device=device)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The dense families' HF names, q/k/v and gate/up fused (pipeline/models/weight_loading.py)."""
        return load_hf_weights(self, weights, {**ATTENTION_FUSED_NAMES, **GATED_MLP_FUSED_NAMES},
                               self.arch.model_type)

    def prepack(self) -> None:
        """Prepack every projection for oneDNN (CPU)."""
        for module in self.modules():
            if isinstance(module, MergedLinear):
                module.prepack()

    def cache_specs(self, kv_dtype: torch.dtype) -> list[PagedKVSpec]:
        return [PagedKVSpec(self.arch.num_kv_heads, self.arch.head_dim, kv_dtype)] * self.arch.num_layers

    @torch.no_grad()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        fill_attention_context(self.rotary_emb, positions, ctx)
        x, residual = embeds, None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x

    @torch.no_grad()
    def write_context(self, hidden: list[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor,
                      caches: list[torch.Tensor]) -> None:
        """Each position's context K/V from the tapped hidden states, into every draft layer's cache at ``slots``
        (padding rows, slot -1, are skipped)."""
        context = self.hidden_norm(self.fc(torch.cat(hidden, dim=-1)))
        cos, sin = self.rotary_emb.cos_sin(positions)
        rows = context.shape[0]
        for layer, cache in zip(self.layers, caches):
            attn = layer.self_attn
            qkv = attn.qkv_proj(context)  # (q is normed and rotated too, and dropped)
            q_end, k_end = attn.q_size, attn.q_size + attn.kv_size
            q = qkv[:, :q_end].view(rows, attn.num_heads, attn.head_dim)
            k = qkv[:, q_end:k_end].view(rows, attn.num_kv_heads, attn.head_dim)
            v = qkv[:, k_end:k_end + attn.kv_size].view(rows, attn.num_kv_heads, attn.head_dim)
            dispatch.qkv_prologue(q, k, v, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin,
                                  attn.is_neox_style, cache, slots)


class ContextTap:
    """What the target's forward calls with the hidden states after ``layers`` (its ``layer_tap``): the drafter's
    context K/V of every position it computed, in the draft caches that follow the target's (from ``first``)."""

    def __init__(self, draft: DFlashDraftModel, first: int) -> None:
        self.draft = draft
        self.layers = frozenset(draft.config.target_layer_ids)
        self.order = draft.config.target_layer_ids
        self.caches = slice(first, first + draft.arch.num_layers)

    def __call__(self, hidden: dict[int, torch.Tensor], positions: torch.Tensor, ctx: ForwardContext) -> None:
        self.draft.write_context([hidden[i] for i in self.order], positions, ctx.attention.slot_mapping,
                                 ctx.caches[self.caches])
