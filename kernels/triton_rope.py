"""Rotary embedding applied in place to q and k in one launch: Triton kernel and torch reference.

``cos``/``sin`` are ``[T, 1, R]`` as ``RotaryEmbedding.cos_sin`` builds them: cos repeated to the full rotary
width and sin signed, so ``out = x * cos + swap(x) * sin``. A rotation pairs element ``a`` with element ``b``
(neox: ``a = i``, ``b = i + R/2``; gptj: ``a = 2i``, ``b = 2i + 1``), hence
``out[a] = x[a] cos[a] + x[b] sin[a]`` and ``out[b] = x[b] cos[b] + x[a] sin[b]``. The kernel loads each
member once, computes in float32 and rounds once; dims ``R..D-1`` (partial rotary) are never touched.
"""

from __future__ import annotations

import torch

from kernels.rope import apply_rotary_emb_
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton


def apply_rotary_ref_(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool = True
) -> None:
    """The oracle: the model's torch rotation on q, then on k."""
    apply_rotary_emb_(q, cos, sin, is_neox_style)
    if k is not None:
        apply_rotary_emb_(k, cos, sin, is_neox_style)


@_jit
def _rotation_pairs(cos_ptr, sin_ptr, cs, cs_s1, half, IS_NEOX: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The pair members' offsets (a, b), their mask, and the token's cos/sin at each, in float32."""
    i = tl.arange(0, BLOCK_HALF)
    mask_i = i < half
    if IS_NEOX:
        off_a = i
        off_b = i + half
    else:
        off_a = 2 * i
        off_b = 2 * i + 1
    cos_a = tl.load(cos_ptr + cs + off_a * cs_s1, mask=mask_i, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + cs + off_b * cs_s1, mask=mask_i, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + cs + off_a * cs_s1, mask=mask_i, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + cs + off_b * cs_s1, mask=mask_i, other=0.0).to(tl.float32)
    return off_a, off_b, mask_i, cos_a, cos_b, sin_a, sin_b


@_jit
def _rotate_heads(
    x_ptr, s_tok, s_head, tok, head0, n_heads, off_a, off_b, mask_i,
    cos_a, cos_b, sin_a, sin_b,
    BLOCK_H: tl.constexpr,
):
    """Rotate heads ``head0 .. head0 + BLOCK_H - 1`` (masked to ``n_heads``) of one token in place."""
    heads = head0 + tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None] & mask_i[None, :]
    base = x_ptr + tok * s_tok + heads.to(tl.int64)[:, None] * s_head
    xa = tl.load(base + off_a[None, :], mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(base + off_b[None, :], mask=mask, other=0.0).to(tl.float32)
    out_a = xa * cos_a[None, :] + xb * sin_a[None, :]
    out_b = xb * cos_b[None, :] + xa * sin_b[None, :]
    tl.store(base + off_a[None, :], out_a.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + off_b[None, :], out_b.to(x_ptr.dtype.element_ty), mask=mask)


@_jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    n_q_heads, n_k_heads, n_q_blocks, half,
    q_s0, q_s1, k_s0, k_s1, cs_s0, cs_s1,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Grid (T, q head blocks + k head blocks): cos/sin of the token are loaded once per program."""
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    off_a, off_b, mask_i, cos_a, cos_b, sin_a, sin_b = _rotation_pairs(
        cos_ptr, sin_ptr, tok * cs_s0, cs_s1, half, IS_NEOX, BLOCK_HALF)
    if hb < n_q_blocks:
        _rotate_heads(q_ptr, q_s0, q_s1, tok, hb * BLOCK_H, n_q_heads, off_a, off_b, mask_i,
                      cos_a, cos_b, sin_a, sin_b, BLOCK_H)
    else:
        _rotate_heads(k_ptr, k_s0, k_s1, tok, (hb - n_q_blocks) * BLOCK_H, n_k_heads, off_a, off_b, mask_i,
                      cos_a, cos_b, sin_a, sin_b, BLOCK_H)


def apply_rotary_triton_(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool = True
) -> None:
    """Rotate ``q [T, H, D]`` and ``k [T, KVH, D]`` in place (strided views of a fused qkv are fine).

    ``k=None`` rotates q alone (e.g. a combined ``[T, H + KVH, D]`` q|k view)."""
    t, n_q, d = q.shape
    rot = cos.shape[-1]
    if rot % 2 or rot > d or cos.shape != sin.shape or cos.shape[0] != t:
        raise ValueError(f"bad cos/sin {tuple(cos.shape)} for q {tuple(q.shape)}")
    if q.stride(-1) != 1 or (k is not None and k.stride(-1) != 1):
        raise ValueError("q and k must be contiguous in their last dim (rotated in place)")
    if k is not None and (k.shape[0] != t or k.shape[2] != d):
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    n_k = k.shape[1] if k is not None else 0
    if t == 0:
        return
    half = rot // 2
    block_half = triton.next_power_of_2(half)
    # ~1K rotated elements per program: a D=128 head block is 8 heads; fewer for narrow GQA k
    block_h = max(1, min(1024 // (2 * block_half), triton.next_power_of_2(max(n_q, n_k))))
    n_q_blocks = triton.cdiv(n_q, block_h)
    n_k_blocks = triton.cdiv(n_k, block_h)
    k_arg = k if k is not None else q
    _rope_kernel[(t, n_q_blocks + n_k_blocks)](
        q, k_arg, cos, sin,
        n_q, n_k, n_q_blocks, half,
        q.stride(0), q.stride(1), k_arg.stride(0), k_arg.stride(1), cos.stride(0), cos.stride(-1),
        IS_NEOX=is_neox_style,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
