"""Rotary position embeddings: inverse frequencies for each rope type and a cos/sin cache (the rotation itself:
kernels/rope.py).

The inverse-frequency formulas follow transformers' ``ROPE_INIT_FUNCTIONS`` (default, linear, dynamic at its
initial length, llama3, yarn) and produce the same float32 values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels.rope import apply_rotary_emb_

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def compute_inv_freq(
    rope_type: str,
    rotary_dim: int,
    rope_theta: float,
    scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 2048,
) -> tuple[torch.Tensor, float]:
    """-> (inv_freq float32 [rotary_dim // 2], attention_scaling applied to cos and sin)."""
    scaling = scaling or {}
    dim = rotary_dim
    base = float(rope_theta)
    if rope_type == "default":
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim) / float(scaling["factor"]), 1.0
    if rope_type == "dynamic":
        # Dynamic NTK only rescales past max_position_embeddings; within it (all the cache covers) it is the
        # transformers init value computed at seq_len = max_position_embeddings.
        factor = float(scaling["factor"])
        seq_len = max_position_embeddings
        base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base, dim, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, dim, scaling, max_position_embeddings)
    supported = ", ".join(SUPPORTED_ROPE_TYPES)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: {supported})")


def _llama3_inv_freq(base: float, dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths: divided by factor; short ones unchanged; in between: smooth interpolation
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, dim: int, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / orig
    attention_factor = scaling.get("attention_factor")
    mscale = scaling.get("mscale")
    mscale_all_dim = scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin cache over positions ``0..max_position_embeddings-1``; ``forward(positions, q, k) -> (q, k)``.

    The cache row of position p holds the full-width cos and signed sin of ``p * inv_freq`` times
    ``attention_scaling`` (each ``rotary_dim`` wide, in the rotation's layout), stored in the module dtype. A forward
    takes ``step_rope(positions)``: the fused prologue kernel reads its rows from the table, the torch paths gather
    them once (``cos_sin``) and every layer calls ``apply_rotary_emb_``.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position_embeddings: int,
        rope_theta: float,
        rope_type: str = "default",
        scaling: dict[str, Any] | None = None,
        is_neox_style: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and <= head_dim, got {rotary_dim} (head_dim {head_dim})")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.is_neox_style = is_neox_style
        inv_freq, self.attention_scaling = compute_inv_freq(
            rope_type, rotary_dim, rope_theta, scaling, max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        # Same float32 products as transformers' position_ids.float() * inv_freq, so the same cos/sin.
        freqs = torch.outer(torch.arange(max_position_embeddings, dtype=torch.float32, device=device), self.inv_freq)
        table_dtype = dtype or torch.get_default_dtype()
        cos = (freqs.cos() * self.attention_scaling).to(table_dtype)
        sin = (freqs.sin() * self.attention_scaling).to(table_dtype)
        # Each position's full-width cos and signed sin side by side ([P, 2 * rotary_dim]), laid out as the rotation
        # reads them: a step takes its rows with one gather, where building them per step cost four kernels.
        if is_neox_style:
            full = torch.cat((cos, cos, -sin, sin), dim=-1)
        else:
            full = torch.cat((cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)), dim=-1)
        self.register_buffer("cos_sin_cache", full, persistent=False)

    @classmethod
    def from_arch(cls, arch, dtype: torch.dtype | None = None, device=None) -> "RotaryEmbedding":
        return cls(
            head_dim=arch.head_dim,
            rotary_dim=arch.rotary_dim,
            max_position_embeddings=arch.max_position_embeddings,
            rope_theta=arch.rope_theta,
            rope_type=arch.rope_type,
            scaling=arch.rope_scaling,
            is_neox_style=not arch.rope_interleaved,
            dtype=dtype,
            device=device,
        )

    def step_rope(self, positions: torch.Tensor) -> "StepRope":
        """A forward's rope: the table and the positions, gathered only where a torch path asks."""
        r = self.rotary_dim
        table = self.cos_sin_cache.unsqueeze(1)
        return StepRope(table[..., :r], table[..., r:], positions, self)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, signed sin), each [T, 1, rotary_dim] (views of one gather); once per step."""
        cs = self.cos_sin_cache.index_select(0, positions).unsqueeze(1)
        return cs[..., : self.rotary_dim], cs[..., self.rotary_dim :]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T], q [T, H, D], k [T, KVH, D] -> rotated (q, k) as new tensors."""
        cos, sin = self.cos_sin(positions)
        q = apply_rotary_emb_(q.clone(), cos.to(q.dtype), sin.to(q.dtype), self.is_neox_style)
        k = apply_rotary_emb_(k.clone(), cos.to(k.dtype), sin.to(k.dtype), self.is_neox_style)
        return q, k

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_pos={self.max_position_embeddings}, "
            f"neox={self.is_neox_style}, attention_scaling={self.attention_scaling}"
        )


@dataclass(slots=True)
class StepRope:
    """One forward's rope: the table's full-width cos and signed sin ([P, 1, rotary_dim] views) and each token's row
    of it (its position). The fused prologue kernel reads a token's row from the table itself, a gather kernel less
    a step; the torch paths take ``gathered()``, computed once a forward."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor
    positions: torch.Tensor
    rotary: RotaryEmbedding
    _gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, rotary_dim]: the step's rows."""
        if self._gathered is None:
            self._gathered = self.rotary.cos_sin(self.positions)
        return self._gathered
