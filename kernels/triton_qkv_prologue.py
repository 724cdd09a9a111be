"""Everything between the qkv projection and attention in one launch: per-head q/k RMSNorm (Qwen3),
RoPE on q and k, and the KV-cache write (padding slots < 0 skipped).

At batch 1 a decode step is a chain of ~450 kernels, and the small ones cost their launch latency,
not their bytes; this prologue replaces four of them per layer (q norm, k norm, rope, KV write).
Rounding happens where the unfused kernels round: the norm rounds to the activation dtype once (as
``triton_norm`` does), the rotation computes in float32 and rounds once (as ``triton_rope`` does). An fp8 cache
gets the rounded k and v quantized with the layer's scales (``kernels/triton_fp8_kv.py``), as the reference's
``write_kv_padded_ref`` quantizes them.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import pdl_launch, pdl_wait
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton
from kernels.triton_fp8_kv import e4m3_bits, is_fp8_kv, store_view
from kernels.triton_kv_cache import write_kv_padded_ref
from kernels.triton_norm import rms_norm_ref
from kernels.triton_rope import _rotation_pairs, apply_rotary_ref_


def qkv_prologue_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     is_neox_style: bool, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The oracle, composed of the unfused references: q and k are normed and rotated in place."""
    if q_norm is not None:
        q.copy_(rms_norm_ref(q, q_norm, eps))
    if k_norm is not None:
        k.copy_(rms_norm_ref(k, k_norm, eps))
    apply_rotary_ref_(q, k, cos, sin, is_neox_style)
    write_kv_padded_ref(k, v, kv_cache_layer, slot_mapping, k_scale, v_scale)


@_jit
def _prologue_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, rows_ptr,
    n_q_heads, head_dim, half, eps,
    q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, cs_s0, cs_s1, c_slot, c_head, k_scale, v_scale,
    HAS_NORM: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr = False, PDL: tl.constexpr = False, KV_FP8: tl.constexpr = False,
):
    """Grid (T, H + KVH): one head of one token per program; k-head programs also move v. ROWS: cos/sin are
    tables, token t's row ``rows[t]``; neither is written in a step, so both are read before the wait. KV_FP8: the
    cache pointers are its bytes; k and v are stored as ``e4m3_bits`` with the layer's scales."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if ROWS:
        off_a, off_b, mask_i, cos_a, cos_b, sin_a, sin_b = _rotation_pairs(
            cos_ptr, sin_ptr, tl.load(rows_ptr + tok).to(tl.int64) * cs_s0, cs_s1, half, IS_NEOX, BLOCK_HALF)
    pdl_wait(PDL)  # dependent launch: kernels/triton_compat.py
    if not ROWS:
        off_a, off_b, mask_i, cos_a, cos_b, sin_a, sin_b = _rotation_pairs(
            cos_ptr, sin_ptr, tok * cs_s0, cs_s1, half, IS_NEOX, BLOCK_HALF)
    is_q = head < n_q_heads
    if is_q:
        base = q_ptr + tok * q_s0 + head.to(tl.int64) * q_s1
        w_ptr = qw_ptr
    else:
        base = k_ptr + tok * k_s0 + (head - n_q_heads).to(tl.int64) * k_s1
        w_ptr = kw_ptr
    dtype = q_ptr.dtype.element_ty
    dims = tl.arange(0, BLOCK_D)
    tail = (dims >= 2 * half) & (dims < head_dim)  # partial rotary: normed, not rotated
    xa = tl.load(base + off_a, mask=mask_i, other=0.0).to(tl.float32)
    xb = tl.load(base + off_b, mask=mask_i, other=0.0).to(tl.float32)
    xt = tl.load(base + dims, mask=tail, other=0.0).to(tl.float32)
    if HAS_NORM:
        x = tl.load(base + dims, mask=dims < head_dim, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x) / head_dim + eps)
        xa = (xa * rstd * tl.load(w_ptr + off_a, mask=mask_i, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        xb = (xb * rstd * tl.load(w_ptr + off_b, mask=mask_i, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        xt = (xt * rstd * tl.load(w_ptr + dims, mask=tail, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    out_a = (xa * cos_a + xb * sin_a).to(dtype)
    out_b = (xb * cos_b + xa * sin_b).to(dtype)
    out_t = xt.to(dtype)
    tl.store(base + off_a, out_a, mask=mask_i)
    tl.store(base + off_b, out_b, mask=mask_i)
    if HAS_NORM:
        tl.store(base + dims, out_t, mask=tail)
    if not is_q:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            kv_head = (head - n_q_heads).to(tl.int64)
            dst = slot * c_slot + kv_head * c_head
            d_ok = dims < head_dim
            v = tl.load(v_ptr + tok * v_s0 + kv_head * v_s1 + dims, mask=d_ok, other=0.0)
            if KV_FP8:  # from the rounded k (what the reference writes), one rounding to e4m3
                tl.store(kc_ptr + dst + off_a, e4m3_bits(out_a, k_scale), mask=mask_i)
                tl.store(kc_ptr + dst + off_b, e4m3_bits(out_b, k_scale), mask=mask_i)
                tl.store(kc_ptr + dst + dims, e4m3_bits(out_t, k_scale), mask=tail)
                tl.store(vc_ptr + dst + dims, e4m3_bits(v, v_scale), mask=d_ok)
            else:
                cache_dtype = kc_ptr.dtype.element_ty
                tl.store(kc_ptr + dst + off_a, out_a.to(cache_dtype), mask=mask_i)
                tl.store(kc_ptr + dst + off_b, out_b.to(cache_dtype), mask=mask_i)
                tl.store(kc_ptr + dst + dims, out_t.to(cache_dtype), mask=tail)
                tl.store(vc_ptr + dst + dims, v.to(cache_dtype), mask=d_ok)


def qkv_prologue_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
                        k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                        is_neox_style: bool, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor,
                        rows: torch.Tensor | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> None:
    """Same contract as ``qkv_prologue_ref``: q [T, H, D], k and v [T, KVH, D] (strided views of the
    fused qkv output are fine), cos/sin [T, 1, R], cache [2, NB, BS, KVH, D], slots [T] (< 0: skip). With
    ``rows`` [T] (integer), cos/sin are tables [P, 1, R] and token t's rotation is row ``rows[t]`` of them.
    ``k_scale`` / ``v_scale``: an fp8 cache's (the layer's, fixed: a CUDA graph captures them)."""
    t, n_q, d = q.shape
    n_k = k.shape[1]
    rot = cos.shape[-1]
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q and k are normed together or not at all")
    if k.shape != (t, n_k, d) or v.shape != k.shape or slot_mapping.shape != (t,):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"slots {tuple(slot_mapping.shape)}")
    if rows is not None and rows.shape != (t,):
        raise ValueError(f"rows {tuple(rows.shape)} for {t} tokens")
    if cos.stride() != sin.stride():
        raise ValueError("cos and sin must have the same strides (views of one table)")
    if rot % 2 or rot > d or cos.shape != sin.shape or (rows is None and cos.shape[0] != t):
        raise ValueError(f"bad cos/sin {tuple(cos.shape)} for q {tuple(q.shape)}")
    if min(q.stride(-1), k.stride(-1), v.stride(-1)) != 1 or max(q.stride(-1), k.stride(-1), v.stride(-1)) != 1:
        raise ValueError("q, k and v must be contiguous in their last dim")
    if kv_cache_layer.shape[-2:] != (n_k, d):
        raise ValueError(f"cache {tuple(kv_cache_layer.shape)} does not hold [{n_k}, {d}] heads")
    if t == 0:
        return
    _, nb, bs, _, _ = kv_cache_layer.shape
    flat = store_view(kv_cache_layer).view(2, nb * bs, n_k, d)
    has_norm = q_norm is not None
    _prologue_kernel[(t, n_q + n_k)](
        q, k, v, q_norm if has_norm else q, k_norm if has_norm else k, cos, sin, flat[0], flat[1],
        slot_mapping.contiguous(), slot_mapping if rows is None else rows.contiguous(), n_q, d, rot // 2, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), cos.stride(-1), flat.stride(1), flat.stride(2), float(k_scale), float(v_scale),
        HAS_NORM=has_norm, IS_NEOX=is_neox_style, BLOCK_HALF=triton.next_power_of_2(max(1, rot // 2)),
        BLOCK_D=triton.next_power_of_2(d), ROWS=rows is not None, KV_FP8=is_fp8_kv(kv_cache_layer),
        num_warps=1 if d <= 128 else 2, **pdl_launch(q),
    )
