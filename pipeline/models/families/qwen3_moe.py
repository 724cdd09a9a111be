"""Qwen3-MoE: the Qwen3 decoder (q/k norm attention over the paged KV cache) with sparse MoE MLPs.

A layer is attention (``attention_layer``) then the MLP ``layer_mlp`` picks: a SparseMoeBlock on the sparse layers
(pipeline/models/moe_layout.py), else a dense GatedMLP of ``intermediate_size``. The experts load from their
per-expert or stacked HF names into each block.
"""
from __future__ import annotations

import torch

from pipeline.dist.group import ExpertGroup
from pipeline.models.causal_lm import CausalLM
from pipeline.models.config import ModelArchConfig
from pipeline.models.decoder_layer import DecoderLayer
from pipeline.models.layers import GATED_MLP_FUSED_NAMES
from pipeline.models.moe_layout import check_moe_fields, join_expert_group, layer_mlp
from pipeline.models.self_attention import ATTENTION_FUSED_NAMES, attention_layer
from pipeline.models.weight_loading import WeightNames

QWEN3_MOE_WEIGHT_NAMES = WeightNames(fused={**ATTENTION_FUSED_NAMES, **GATED_MLP_FUSED_NAMES})


def qwen3_moe_decoder_layer(arch: ModelArchConfig, layer_index: int, dtype=None, device=None) -> DecoderLayer:
    return DecoderLayer(arch, "self_attn", attention_layer(arch, layer_index, dtype, device),
                        layer_mlp(arch, layer_index, dtype, device), dtype, device)


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE decoder layers in the causal-LM shell; ``join_expert_group`` for expert parallelism."""

    weight_names = QWEN3_MOE_WEIGHT_NAMES

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype | None = None, device=None) -> None:
        check_moe_fields(arch)
        super().__init__(arch, qwen3_moe_decoder_layer, dtype, device)

    def join_expert_group(self, group: ExpertGroup) -> None:
        """Expert parallelism: the MoE blocks sum their partial outputs over ``group``."""
        join_expert_group(self, group)
