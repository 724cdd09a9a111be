"""Gated attention (Qwen3-Next, Qwen3.5 and their MTP head): the shared PagedAttention with a per-head sigmoid gate
on its output, q/k norms always on (zero-centred where the model's norms are) and the config's partial rotary.

The checkpoint's ``q_proj`` holds each head's query and gate side by side ([heads, 2, head_dim] rows); loading
splits it into the query shard and the gate shard (``q_gate``, the fused projection's fourth) of ``qkv_proj``.
"""
from __future__ import annotations

import torch

from kernels.fp8 import Fp8Weight
from pipeline.models.config import ModelArchConfig
from pipeline.models.self_attention import PagedAttention

# the gate half of the HF q_proj, as ``split_query_gate`` names it: HF name piece -> (fused piece, shard index)
GATED_ATTENTION_FUSED_NAMES = {"self_attn.q_gate": ("self_attn.qkv_proj", 3)}


def gated_attention_layer(arch: ModelArchConfig, cache_index: int, dtype=None, device=None) -> PagedAttention:
    """The hybrid families' attention layer over the paged K/V cache ``cache_index``."""
    return PagedAttention(
        cache_index, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
        qkv_bias=arch.attention_bias, o_bias=arch.o_proj_bias, qk_norm=True, rms_norm_eps=arch.rms_norm_eps,
        is_neox_style=not arch.rope_interleaved, output_gate=arch.attn_output_gate,
        zero_centered_qk_norm=arch.zero_centered_norm, dtype=dtype, device=device)


def split_query_gate(name: str, tensor: torch.Tensor, arch: ModelArchConfig) -> list[tuple[str, torch.Tensor]] | None:
    """A gated ``q_proj`` weight or bias as its query rows and its gate rows (``q_gate``); None for any other
    tensor, and for every tensor of a model without the output gate. An FP8 weight's scales are cut with its rows
    (exactly)."""
    if not arch.attn_output_gate or not name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return None
    gate_name = name.replace("q_proj", "q_gate")
    if isinstance(tensor, Fp8Weight) and name.endswith(".weight"):
        heads = torch.arange(2 * arch.q_size, device=tensor.q.device).view(arch.num_heads, 2, arch.head_dim)
        return [(name, tensor.take_rows(heads[:, 0].reshape(-1))),
                (gate_name, tensor.take_rows(heads[:, 1].reshape(-1)))]
    heads = tensor.view(arch.num_heads, 2, arch.head_dim, *tensor.shape[1:])
    return [(name, heads[:, 0].reshape(arch.q_size, *tensor.shape[1:])),
            (gate_name, heads[:, 1].reshape(arch.q_size, *tensor.shape[1:]))]
