"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid decoders of Gated DeltaNet and gated full-attention layers.

The config's ``layer_types`` say which mixer each layer has: ``linear_attention`` (pipeline/models/
gated_delta_net.py) or ``full_attention`` (the shared PagedAttention with a sigmoid output gate, partial rotary
and zero-centred q/k norms). The MLP is the shared SparseMoeBlock (routed experts plus the gated shared expert)
or a dense GatedMLP, by the same rule as Qwen3-MoE. Every RMSNorm but the delta-rule output norm is zero-centred.

Caches: one paged K/V cache per attention layer first (cache indices 0..A-1), then two state tensors per
GDN layer (conv window, delta-rule state), indexed by each row's state slot.

Weights load from the text model's HF names; a multimodal checkpoint's ``model.language_model.`` prefix is
dropped and its vision tower (``model.visual.``) skipped; so is its MTP head (``mtp.``) unless ``attach_mtp`` built
it for speculation (pipeline/models/mtp.py), whose two caches then follow the model's own. The attention ``q_proj``
holds each head's query and gate side by side; they are split into the fused projection's q and gate shards.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kernels.fp8 import Fp8Weight
from pipeline.dist.group import ExpertGroup
from pipeline.models.config import ModelArchConfig
from pipeline.models.forward_context import CacheSpec, ForwardContext, PagedKVSpec
from pipeline.models.gated_delta_net import GatedDeltaNet, split_qwen3_next_projections
from pipeline.models.layers import GatedMLP, PagedAttention, RMSNorm, norm_project
from pipeline.models.llama import _FUSED
from pipeline.models.mtp import MultiTokenPredictor, hidden_cache_spec
from pipeline.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer, make_sparse_moe_block

_SKIPPED_PREFIXES = ("model.visual.", "visual.")


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


class HybridDecoderLayer(nn.Module):
    """A GDN or gated-attention mixer, then the MLP, each behind a fused residual-add zero-centred RMSNorm."""

    def __init__(self, arch: ModelArchConfig, layer_index: int, dtype=None, device=None) -> None:
        super().__init__()
        cache_index = cache_layout(arch)[layer_index]
        zero = arch.zero_centered_norm
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device, zero)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: PagedAttention | None = None
        if arch.layer_types[layer_index] == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                cache_index, arch.hidden_size, arch.linear_num_key_heads, arch.linear_num_value_heads,
                arch.linear_key_head_dim, arch.linear_value_head_dim, arch.linear_conv_kernel_dim, arch.rms_norm_eps,
                dtype, device)
        else:
            self.self_attn = PagedAttention(
                cache_index, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                qkv_bias=arch.attention_bias, o_bias=arch.o_proj_bias, qk_norm=True, rms_norm_eps=arch.rms_norm_eps,
                is_neox_style=not arch.rope_interleaved, output_gate=arch.attn_output_gate,
                zero_centered_qk_norm=zero, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device, zero)
        if is_sparse_layer(arch, layer_index):
            self.mlp: nn.Module = make_sparse_moe_block(arch, dtype, device)
        else:
            self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias, arch.hidden_act, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = self.linear_attn if self.linear_attn is not None else self.self_attn
        projected, residual, _ = norm_project(self.input_layernorm, x, residual, mixer.input_proj)
        x = mixer.forward_projected(projected, ctx)
        projected, residual, normed = norm_project(self.post_attention_layernorm, x, residual, self.mlp.input_proj,
                                                   keep_normed=self.mlp.reuses_input)
        return self.mlp.forward_projected(projected, normed), residual


class Qwen3NextForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-Next / Qwen3.5 / Qwen3.5-MoE text models over paged KV and recurrent state slots."""

    decoder_layer_cls = HybridDecoderLayer
    fused_names = {
        **_FUSED,
        "self_attn.q_gate": ("self_attn.qkv_proj", 3),  # the gate half of the HF q_proj (see _hf_names)
        "linear_attn.in_proj_qkv": ("linear_attn.in_proj", 0),
        "linear_attn.in_proj_z": ("linear_attn.in_proj", 1),
        "linear_attn.in_proj_b": ("linear_attn.in_proj", 2),
        "linear_attn.in_proj_a": ("linear_attn.in_proj", 3),
    }

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype | None = None, device=None) -> None:
        if not arch.layer_types or "full_attention" not in arch.layer_types:
            raise ValueError(f"{arch.model_type}: layer_types must name the layers' mixers and include at least "
                             "one full_attention layer")
        super().__init__(arch, dtype, device)
        self.mtp: MultiTokenPredictor | None = None

    def _linear_attention(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.linear_attn is not None]

    def after_load(self) -> None:
        """Expert parallelism with ``arch.linear_head_shard``: each Gated DeltaNet layer keeps this rank's heads."""
        shard = self.arch.linear_head_shard
        if shard.size > 1:
            for mixer in self._linear_attention():
                mixer.keep_heads(shard.rank, shard.size)

    def join_expert_group(self, group: ExpertGroup) -> None:
        """The MoE blocks sum over ``group``, and so do Gated DeltaNet layers that keep a share of the heads."""
        super().join_expert_group(group)
        if self.arch.linear_head_shard.size > 1:
            for mixer in self._linear_attention():
                mixer.head_group = group

    def attach_mtp(self) -> None:
        """Build the MTP head (before loading: its ``mtp.*`` weights load with the model's) and store the hidden
        states it reads from every forward on."""
        param = self.model.embed_tokens.weight
        self.mtp = MultiTokenPredictor(self.arch, param.dtype, param.device)
        self.hidden_cache_index = len(self._own_cache_specs(param.dtype)) + 1

    def cache_specs(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> list[CacheSpec]:
        """The attention layers' K/V (in ``kv_dtype``, default ``dtype``), the GDN states; with the MTP head, its
        K/V and the hidden-state cache, both in ``dtype`` (the head reads them as the model computed them)."""
        specs = self._own_cache_specs(dtype, kv_dtype)
        if self.mtp is not None:
            specs += [PagedKVSpec(self.arch.num_kv_heads, self.arch.head_dim, dtype),
                      hidden_cache_spec(self.arch.hidden_size, dtype)]
        return specs

    def _own_cache_specs(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> list[CacheSpec]:
        specs: list[CacheSpec] = [PagedKVSpec(self.arch.num_kv_heads, self.arch.head_dim, kv_dtype or dtype)
                                  for kind in self.arch.layer_types if kind == "full_attention"]
        for layer in self.model.layers:
            if layer.linear_attn is not None:
                specs.extend(layer.linear_attn.state_specs(dtype))
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

    def _hf_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's names as this model's loader reads them (see the module docstring)."""
        arch = self.arch
        for name, tensor in weights:
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            elif name.startswith("language_model."):
                name = name[len("language_model."):]
            if name.startswith(_SKIPPED_PREFIXES) or (self.mtp is None and name.startswith("mtp.")):
                continue
            if name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
                yield from split_qwen3_next_projections(name, tensor, arch.linear_num_key_heads,
                                                        arch.linear_num_value_heads, arch.linear_key_head_dim,
                                                        arch.linear_value_head_dim)
            elif name.endswith("self_attn.q_proj.weight") and arch.attn_output_gate and isinstance(tensor, Fp8Weight):
                heads = torch.arange(2 * arch.q_size, device=tensor.q.device).view(arch.num_heads, 2, arch.head_dim)
                yield name, tensor.take_rows(heads[:, 0].reshape(-1))  # the scales cut with the rows (exactly)
                yield name.replace("q_proj", "q_gate"), tensor.take_rows(heads[:, 1].reshape(-1))
            elif name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")) and arch.attn_output_gate:
                heads = tensor.view(arch.num_heads, 2, arch.head_dim, *tensor.shape[1:])
                yield name, heads[:, 0].reshape(arch.q_size, *tensor.shape[1:])
                yield name.replace("q_proj", "q_gate"), heads[:, 1].reshape(arch.q_size, *tensor.shape[1:])
            else:
                yield name, tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(self._hf_names(weights))
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.absorb_offset()
        return loaded
