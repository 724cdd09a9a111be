"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid decoders of Gated DeltaNet and gated full-attention layers.

The config's ``layer_types`` say which mixer each layer has: ``linear_attention`` (pipeline/models/
gated_delta_net.py) or ``full_attention`` (pipeline/models/gated_attention.py: a sigmoid output gate, partial
rotary and zero-centred q/k norms). The MLP is the shared SparseMoeBlock (routed experts plus the gated shared
expert) or a dense GatedMLP, by the rule of pipeline/models/moe_layout.py. Every RMSNorm but the delta-rule output
norm is zero-centred.

Caches: one paged K/V cache per attention layer first (cache indices 0..A-1), then two state tensors per
GDN layer (conv window, delta-rule state), indexed by each row's state slot.

Weights load from the text model's HF names; a multimodal checkpoint's ``model.language_model.`` prefix is
dropped and its vision tower (``model.visual.``) skipped; so is its MTP head (``mtp.``) unless ``attach_mtp`` built
it for speculation (pipeline/models/mtp.py), whose two caches then follow the model's own.
"""
from __future__ import annotations

import torch

from pipeline.dist.group import ExpertGroup
from pipeline.models.causal_lm import CausalLM
from pipeline.models.config import ModelArchConfig
from pipeline.models.decoder_layer import DecoderLayer
from pipeline.models.forward_context import CacheSpec, ForwardContext, PagedKVSpec
from pipeline.models.gated_attention import GATED_ATTENTION_FUSED_NAMES, gated_attention_layer, split_query_gate
from pipeline.models.gated_delta_net import (GATED_DELTA_NET_FUSED_NAMES, GatedDeltaNet, gated_delta_net_layer,
                                             split_grouped_projections)
from pipeline.models.layers import GATED_MLP_FUSED_NAMES
from pipeline.models.moe_layout import check_moe_fields, join_expert_group, layer_mlp
from pipeline.models.mtp import MultiTokenPredictor, hidden_cache_spec
from pipeline.models.self_attention import ATTENTION_FUSED_NAMES
from pipeline.models.weight_loading import WeightNames

HYBRID_WEIGHT_NAMES = WeightNames(
    fused={**ATTENTION_FUSED_NAMES, **GATED_MLP_FUSED_NAMES, **GATED_ATTENTION_FUSED_NAMES,
           **GATED_DELTA_NET_FUSED_NAMES},
    renamed=(("model.language_model.", "model."), ("language_model.", "")),
    skipped=("model.visual.", "visual."),
    optional=("mtp",),
    splits=(split_grouped_projections, split_query_gate),
)


def cache_layout(arch: ModelArchConfig) -> list[int]:
    """Each layer's cache index: attention layers number 0..A-1, GDN layers A, A+2, ... (two tensors each)."""
    num_attention = sum(t == "full_attention" for t in arch.layer_types)
    indices, attention, linear = [], 0, 0
    for kind in arch.layer_types:
        if kind == "full_attention":
            indices.append(attention)
            attention += 1
        else:
            indices.append(num_attention + 2 * linear)
            linear += 1
    return indices


def hybrid_decoder_layer(arch: ModelArchConfig, layer_index: int, dtype=None, device=None) -> DecoderLayer:
    """A Gated DeltaNet or gated-attention mixer by ``layer_types``, then the layer's MLP."""
    cache_index = cache_layout(arch)[layer_index]
    if arch.layer_types[layer_index] == "linear_attention":
        name, mixer = "linear_attn", gated_delta_net_layer(arch, cache_index, dtype, device)
    else:
        name, mixer = "self_attn", gated_attention_layer(arch, cache_index, dtype, device)
    return DecoderLayer(arch, name, mixer, layer_mlp(arch, layer_index, dtype, device), dtype, device)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next / Qwen3.5 / Qwen3.5-MoE text models over paged KV and recurrent state slots."""

    weight_names = HYBRID_WEIGHT_NAMES

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype | None = None, device=None) -> None:
        if not arch.layer_types or "full_attention" not in arch.layer_types:
            raise ValueError(f"{arch.model_type}: layer_types must name the layers' mixers and include at least "
                             "one full_attention layer")
        check_moe_fields(arch)
        super().__init__(arch, hybrid_decoder_layer, dtype, device)
        self.mtp: MultiTokenPredictor | None = None

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.linear_attn is not None]

    def after_load(self) -> None:
        """Expert parallelism with ``arch.linear_head_shard``: each Gated DeltaNet layer keeps this rank's heads."""
        shard = self.arch.linear_head_shard
        if shard.size > 1:
            for mixer in self.linear_attention_layers():
                mixer.keep_heads(shard.rank, shard.size)

    def join_expert_group(self, group: ExpertGroup) -> None:
        """The MoE blocks sum over ``group``, and so do Gated DeltaNet layers that keep a share of the heads."""
        join_expert_group(self, group)
        if self.arch.linear_head_shard.size > 1:
            for mixer in self.linear_attention_layers():
                mixer.head_group = group

    def attach_mtp(self) -> None:
        """Build the MTP head (before loading: its ``mtp.*`` weights load with the model's) and store the hidden
        states it reads from every forward on."""
        param = self.model.embed_tokens.weight
        self.mtp = MultiTokenPredictor(self.arch, param.dtype, param.device)
        self.hidden_cache_index = len(self.own_cache_specs(param.dtype)) + 1

    def cache_specs(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> list[CacheSpec]:
        """The attention layers' K/V (in ``kv_dtype``, default ``dtype``), the GDN states; with the MTP head, its
        K/V and the hidden-state cache, both in ``dtype`` (the head reads them as the model computed them)."""
        specs = self.own_cache_specs(dtype, kv_dtype)
        if self.mtp is not None:
            specs += [PagedKVSpec(self.arch.num_kv_heads, self.arch.head_dim, dtype),
                      hidden_cache_spec(self.arch.hidden_size, dtype)]
        return specs

    def own_cache_specs(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> list[CacheSpec]:
        """The decoder's own caches, in cache-index order (``cache_layout``), without the MTP head's."""
        specs: list[CacheSpec] = [PagedKVSpec(self.arch.num_kv_heads, self.arch.head_dim, kv_dtype or dtype)
                                  for kind in self.arch.layer_types if kind == "full_attention"]
        for mixer in self.linear_attention_layers():
            specs.extend(mixer.state_specs(dtype))
        return specs

    @torch.no_grad()
    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                    ctx: ForwardContext) -> torch.Tensor:
        """The MTP head at ``positions``: ``input_ids`` the tokens after them, ``hidden`` the target's (or the
        head's own) hidden states there; ``ctx.caches`` holds the head's K/V cache alone."""
        assert self.mtp is not None
        self.prepare_context(positions, ctx)
        return self.mtp(self.model.embed_tokens(input_ids), hidden, ctx)

    def prepare_context(self, positions: torch.Tensor, ctx: ForwardContext) -> None:
        """Also ``ctx.has_initial_state``: the recurrent layers continue a row's state unless its chunk starts at
        position 0 (a new or recomputed sequence: whatever its slot held before is ignored)."""
        super().prepare_context(positions, ctx)
        meta = ctx.attention
        qsl = meta.query_start_loc
        ctx.has_initial_state = (meta.seq_lens - (qsl[1:] - qsl[:-1])) > 0
