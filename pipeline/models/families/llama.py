"""The dense decoder family over a paged KV cache: Llama, Mistral (= Llama), Qwen2 (qkv bias), Qwen3 (q/k norm).

Every layer is attention (``attention_layer``: biases and q/k norms as the config says) then a dense GatedMLP;
every layer attends, so its cache index is its layer index.
"""
from __future__ import annotations

import torch

from pipeline.models.causal_lm import CausalLM
from pipeline.models.config import ModelArchConfig
from pipeline.models.decoder_layer import DecoderLayer
from pipeline.models.layers import GATED_MLP_FUSED_NAMES, GatedMLP
from pipeline.models.self_attention import ATTENTION_FUSED_NAMES, attention_layer
from pipeline.models.weight_loading import WeightNames

DENSE_WEIGHT_NAMES = WeightNames(fused={**ATTENTION_FUSED_NAMES, **GATED_MLP_FUSED_NAMES})


def dense_decoder_layer(arch: ModelArchConfig, layer_index: int, dtype=None, device=None) -> DecoderLayer:
    return DecoderLayer(arch, "self_attn", attention_layer(arch, layer_index, dtype, device),
                        GatedMLP.from_arch(arch, dtype, device), dtype, device)


class LlamaForCausalLM(CausalLM):
    """Dense decoder layers in the causal-LM shell (pipeline/models/causal_lm.py)."""

    weight_names = DENSE_WEIGHT_NAMES

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__(arch, dense_decoder_layer, dtype, device)
