"""The decoder layer every family composes: a token mixer, then an MLP, each behind a fused residual-add RMSNorm.

The family picks the parts per layer index: the mixer (PagedAttention, gated attention or a Gated DeltaNet) and the
MLP (a dense GatedMLP or a SparseMoeBlock). The mixer is registered under the checkpoint's name for it,
``self_attn`` or ``linear_attn``, so the parameters carry the HF names; the other name holds None.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from pipeline.models.config import ModelArchConfig
from pipeline.models.forward_context import ForwardContext
from pipeline.models.layers import MergedLinear, RMSNorm, norm_project

MIXER_NAMES = ("self_attn", "linear_attn")  # the checkpoint's names for an attention / a linear-attention mixer


class Mixer(Protocol):
    @property
    def input_proj(self) -> MergedLinear: ...  # the projection the input norm may run inside

    def forward_projected(self, projected: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...


class Mlp(Protocol):
    reuses_input: bool  # forward_projected reads the normed input as well as its projection

    @property
    def input_proj(self) -> MergedLinear: ...

    def forward_projected(self, projected: torch.Tensor, normed: torch.Tensor | None) -> torch.Tensor: ...


class DecoderLayer(nn.Module):
    """``forward(x, residual, ctx) -> (x, residual)``: the two halves of the layer's output, summed by the next
    norm. ``mixer_name`` is one of ``MIXER_NAMES``."""

    def __init__(self, arch: ModelArchConfig, mixer_name: str, mixer: nn.Module, mlp: nn.Module, dtype=None,
                 device=None) -> None:
        super().__init__()
        if mixer_name not in MIXER_NAMES:
            raise ValueError(f"mixer_name {mixer_name!r} is not one of {MIXER_NAMES}")
        zero = arch.zero_centered_norm
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device, zero)
        self.self_attn: nn.Module | None = None
        self.linear_attn: nn.Module | None = None
        setattr(self, mixer_name, mixer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device, zero)
        self.mlp = mlp

    @property
    def mixer(self) -> Mixer:
        return self.self_attn if self.self_attn is not None else self.linear_attn

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = self.mixer
        projected, residual, _ = norm_project(self.input_layernorm, x, residual, mixer.input_proj)
        x = mixer.forward_projected(projected, ctx)
        projected, residual, normed = norm_project(self.post_attention_layernorm, x, residual, self.mlp.input_proj,
                                                   keep_normed=self.mlp.reuses_input)
        return self.mlp.forward_projected(projected, normed), residual
