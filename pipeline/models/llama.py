"""The dense decoder family over a paged KV cache: Llama, Mistral (= Llama), Qwen2 (qkv bias), Qwen3 (q/k norm)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import replace
from typing import Protocol

import torch
from torch import nn

from kernels.dispatch import MAX_DECODE_ROW_TOKENS, decode_rows_on, use_triton
from kernels.fp8 import Fp8Weight
from kernels.paged_attention import plan_paged_attention
from kernels.triton_decode_attention import decode_rows
from kernels.triton_paged_attention import TritonAttentionPlan
from pipeline.models.config import ModelArchConfig
from pipeline.models.forward_context import ForwardContext, PagedKVSpec
from pipeline.models.layers import (
    Embedding,
    GatedMLP,
    Linear,
    MergedLinear,
    PagedAttention,
    RMSNorm,
    can_prepack,
    logits_linear,
    norm_project,
    packed_linear,
    prepack_weight,
)
from pipeline.models.mtp import write_hidden
from pipeline.models.rope import RotaryEmbedding


class LayerTap(Protocol):
    layers: frozenset[int]  # the decoder layers whose outputs it takes

    def __call__(self, hidden: dict[int, torch.Tensor], positions: torch.Tensor, ctx: ForwardContext) -> None: ...


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


class LlamaDecoderLayer(nn.Module):
    """Attention then MLP, each behind a fused residual-add RMSNorm. Every layer attends, so its
    cache index is its layer index."""

    def __init__(self, arch: ModelArchConfig, layer_index: int, dtype=None, device=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.self_attn = PagedAttention(
            layer_index,
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
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.mlp = self._make_mlp(arch, layer_index, dtype, device)

    def _make_mlp(self, arch: ModelArchConfig, layer_index: int, dtype=None, device=None) -> nn.Module:
        """The layer's MLP (a hook: MoE families return a sparse block here)."""
        return GatedMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias, arch.hidden_act, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual, _ = norm_project(self.input_layernorm, x, residual, self.self_attn.input_proj)
        x = self.self_attn.forward_projected(qkv, ctx)
        projected, residual, normed = norm_project(self.post_attention_layernorm, x, residual, self.mlp.input_proj,
                                                   keep_normed=self.mlp.reuses_input)
        return self.mlp.forward_projected(projected, normed), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype=None, device=None, layer_cls: type = LlamaDecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype, device)
        self.layers = nn.ModuleList([layer_cls(arch, i, dtype, device) for i in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device, arch.zero_centered_norm)
        self.rotary_emb = RotaryEmbedding.from_arch(arch, dtype=dtype, device=device)


# HF name pieces fused into one parameter: suffix -> (fused suffix, shard index)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_IGNORED_RE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]`` (final norm applied);
    ``compute_logits(hidden [S, hidden]) -> [S, vocab] float32``; ``cache_specs(dtype, kv_dtype)`` -> the caches
    ``ctx.caches`` must hold (one paged K/V cache per layer)."""

    decoder_layer_cls: type = LlamaDecoderLayer  # a hook for families that only change the layer
    fused_names: dict[str, tuple[str, int]] = _FUSED  # HF name pieces loaded as shards of one parameter

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        if arch.sliding_window is not None and arch.sliding_window < arch.max_position_embeddings:
            # Windowed attention is not implemented; exact for contexts up to the window.
            warnings.warn(
                f"{arch.model_type}: sliding_window={arch.sliding_window} is not applied; "
                "attention is full-context (exact only up to the window)",
                stacklevel=2,
            )
        self.arch = arch
        self.model = LlamaModel(arch, dtype, device, self.decoder_layer_cls)
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

    def cache_specs(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> list[PagedKVSpec]:
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

    def _hf_loaded_params(self) -> dict[str, nn.Parameter]:
        """The parameters ``load_weights`` fills by (fused) HF name (a hook: subclasses drop those they
        load themselves)."""
        return dict(self.named_parameters())

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load tensors given under HF names; fuses q/k/v and gate/up. Returns the HF names loaded.

        Raises KeyError on an unknown name, ValueError on a shape mismatch and on missing tensors.
        """
        params = self._hf_loaded_params()
        # every (parameter, shard) that must be filled, keyed by the HF name that fills it
        expected: dict[str, tuple[str, int | None]] = {}
        for pname in params:
            mod_name, _, leaf = pname.rpartition(".")
            fused = [(hf, fs, idx) for hf, (fs, idx) in self.fused_names.items() if mod_name.endswith("." + fs)]
            for hf_suffix, fs, idx in fused:
                expected[f"{mod_name[: -len(fs)]}{hf_suffix}.{leaf}"] = (pname, idx)
            if not fused:
                expected[pname] = (pname, None)
        tied = self.lm_head is None
        loaded: set[str] = set()
        unknown: list[str] = []
        for name, tensor in weights:
            if _IGNORED_RE.search(name) or (tied and name == "lm_head.weight"):
                continue
            target = expected.get(name)
            if target is None:
                unknown.append(name)
                continue
            pname, shard = target
            param = params[pname]
            module_name, _, leaf = pname.rpartition(".")
            module = self.get_submodule(module_name) if shard is not None or leaf == "weight" else None
            if isinstance(module, MergedLinear) and leaf == "weight":  # 16-bit or FP8 storage (fp8_storage.py)
                module.load_weight(shard, name, tensor)
                loaded.add(name)
                continue
            if shard is None:
                dst = param.data
            else:
                start, end = module.shard_range(shard)
                dst = param.data[start:end]
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
            dst.copy_(tensor.dequantize(dst.dtype) if isinstance(tensor, Fp8Weight) else tensor)
            loaded.add(name)
        if unknown:
            shown = ", ".join(unknown[:10]) + (f" ... (+{len(unknown) - 10} more)" if len(unknown) > 10 else "")
            raise KeyError(f"{self.arch.model_type}: unknown weight names: {shown}")
        missing = sorted(set(expected) - loaded)
        if missing:
            shown = ", ".join(missing[:10]) + (f" ... (+{len(missing) - 10} more)" if len(missing) > 10 else "")
            raise ValueError(f"{self.arch.model_type}: missing weights: {shown}")
        return loaded
