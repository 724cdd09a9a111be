"""The rotary rotation in torch: what the model's torch paths run, and the reference of the Triton kernels
(triton_rope.py, the fused prologue in triton_qkv_prologue.py). The cos/sin tables come from the model
(pipeline/models/rope.py ``RotaryEmbedding``), which imports this module.
"""

from __future__ import annotations

import torch


def apply_rotary_emb_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool = True
) -> torch.Tensor:
    """Rotate ``x [T, N, D]`` in place (the first ``cos.shape[-1]`` dims of each head); returns x.

    ``cos``/``sin`` are ``[T, 1, rotary_dim]`` from ``RotaryEmbedding.cos_sin``: cos repeated to full width and
    sin signed so that ``x * cos + swap(x) * sin`` is the rotation, where swap exchanges the two halves (neox)
    or the two members of each pair (gptj).
    """
    rot = cos.shape[-1]
    xr = x if rot == x.shape[-1] else x[..., :rot]
    if is_neox_style:
        swapped = xr.unflatten(-1, (2, rot // 2)).flip(-2).flatten(-2)
    else:
        swapped = xr.unflatten(-1, (rot // 2, 2)).flip(-1).flatten(-2)
    xr.mul_(cos).addcmul_(swapped, sin)
    return x
