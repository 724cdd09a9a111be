"""The causal-LM shell every family fills: token embedding, the family's decoder layers, final norm, rope, lm_head,
and what a serving model does around them (the forward over the caches, logits, prepacking, loading).

A family subclasses ``CausalLM`` with its layer builder (which mixer and which MLP each layer index gets) and its
``weight_names``; it overrides ``cache_specs`` and ``prepare_context`` only where its layers need more than one paged
K/V cache per layer and the rope and attention plan.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn

from pipeline.models.config import ModelArchConfig
from pipeline.models.decoder_layer import DecoderLayer
from pipeline.models.forward_context import CacheSpec, ForwardContext, PagedKVSpec
from pipeline.models.layers import (Embedding, Linear, MergedLinear, RMSNorm, can_prepack, logits_linear,
                                    packed_linear, prepack_weight)
from pipeline.models.mtp import write_hidden
from pipeline.models.rope import RotaryEmbedding
from pipeline.models.self_attention import fill_attention_context
from pipeline.models.weight_loading import WeightNames, load_hf_weights

# (arch, layer index, dtype, device) -> that layer
LayerBuilder = Callable[[ModelArchConfig, int, torch.dtype | None, object], DecoderLayer]


class LayerTap(Protocol):
    layers: frozenset[int]  # the decoder layers whose outputs it takes

    def __call__(self, hidden: dict[int, torch.Tensor], positions: torch.Tensor, ctx: ForwardContext) -> None: ...


class DecoderModel(nn.Module):
    """The HF ``model.*`` module: ``embed_tokens``, ``layers``, ``norm`` and the rope tables."""

    def __init__(self, arch: ModelArchConfig, build_layer: LayerBuilder, dtype=None, device=None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype, device)
        self.layers = nn.ModuleList([build_layer(arch, i, dtype, device) for i in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device, arch.zero_centered_norm)
        self.rotary_emb = RotaryEmbedding.from_arch(arch, dtype=dtype, device=device)


class CausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]`` (final norm applied);
    ``compute_logits(hidden [S, hidden]) -> [S, vocab] float32``; ``cache_specs(dtype, kv_dtype)`` -> the caches
    ``ctx.caches`` must hold (by default one paged K/V cache per layer)."""

    weight_names: WeightNames  # set by each family

    def __init__(self, arch: ModelArchConfig, build_layer: LayerBuilder, dtype: torch.dtype | None = None,
                 device=None) -> None:
        super().__init__()
        if arch.sliding_window is not None and arch.sliding_window < arch.max_position_embeddings:
            # Windowed attention is not implemented; exact for contexts up to the window.
            warnings.warn(
                f"{arch.model_type}: sliding_window={arch.sliding_window} is not applied; "
                "attention is full-context (exact only up to the window)",
                stacklevel=3,
            )
        self.arch = arch
        self.model = DecoderModel(arch, build_layer, dtype, device)
        self.lm_head = (
            None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size, False, dtype, device)
        )
        self.lm_head_packed: torch.Tensor | None = None  # tied lm_head, packed by prepack()
        # a drafter that reads the target's hidden states (pipeline/models/mtp.py): every forward stores them there
        self.hidden_cache_index: int | None = None
        # a drafter that reads chosen layers' hidden states (pipeline/models/dflash.py): every forward hands them over
        self.layer_tap: LayerTap | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def cache_specs(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> list[CacheSpec]:
        """One paged K/V cache per layer, in layer (= cache-index) order; the runner allocates them. ``kv_dtype``:
        the attention layers' K/V (fp8 with --kv-cache-dtype fp8), ``dtype`` otherwise."""
        spec = PagedKVSpec(self.arch.num_kv_heads, self.arch.head_dim, kv_dtype or dtype)
        return [spec] * self.arch.num_layers

    def prepare_context(self, positions: torch.Tensor, ctx: ForwardContext) -> None:
        """Fills what every layer reads from ``ctx`` and is computed once a forward: ``ctx.rope`` and
        ``ctx.attention_plan``."""
        fill_attention_context(self.model.rotary_emb, positions, ctx)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``prepare_context``, then the layers over ``ctx.caches``."""
        m = self.model
        x = m.embed_tokens(input_ids)
        self.prepare_context(positions, ctx)
        residual = None
        tap, tapped = self.layer_tap, {}
        for index, layer in enumerate(m.layers):
            x, residual = layer(x, residual, ctx)
            if tap is not None and index in tap.layers:
                tapped[index] = x + residual  # the layer's output (its two halves are summed by the next norm)
        x, _ = m.norm(x, residual)
        if self.hidden_cache_index is not None:
            write_hidden(ctx.caches[self.hidden_cache_index], ctx.attention.slot_mapping, x)
        if tap is not None:
            tap(tapped, positions, ctx)
        return x

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None and self.lm_head.packed is not None:
            return self.lm_head(hidden).float()
        if self.lm_head_packed is not None:
            return packed_linear(hidden, self.lm_head_packed, None).float()
        return logits_linear(hidden, self.lm_head_weight)

    def prepack(self) -> None:
        """Prepack every projection for oneDNN (CPU). A tied lm_head gets its own packed copy, since
        the embedding lookup still needs the plain table."""
        for module in self.modules():
            if isinstance(module, MergedLinear):
                module.prepack()
        if self.lm_head is None and can_prepack(self.model.embed_tokens.weight):
            self.lm_head_packed = prepack_weight(self.model.embed_tokens.weight)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors given under HF names (``weight_names`` maps them; pipeline/models/weight_loading.py).
        Returns the HF names loaded. A zero-centred norm's loaded w then becomes its scale 1 + w.

        Raises KeyError on an unknown name, ValueError on a shape mismatch and on missing tensors.
        """
        names = self.weight_names
        loaded = load_hf_weights(self, names.model_tensors(self, self.arch, weights), names.fused,
                                 self.arch.model_type)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.absorb_offset()
        return loaded
