"""Decode attention over the paged cache (one new token per sequence): flash-decoding in Triton, same contract
as ``kernels.paged_attention`` for decode-only steps.

Grid ``(B, KVH, num_splits)``; the query heads of a KV head are the rows of the Q tile (padded to 16 for
``tl.dot``). Each sequence's context is cut on the device into ``num_splits`` equal parts (rounded up to BLOCK_N),
each part writes a normalized partial output and its log-sum-exp, and a small reduce kernel combines them.
``decode_num_splits`` picks the count from the batch shape; with one split the kernel writes the output directly
and no reduce runs. With a ``DecodePrologue`` the split kernel also does the qkv prologue's work (q/k norm, rope,
the new K/V written to the cache), one kernel a layer fewer. The key tile step, the output gate and the plan are
shared with the prefill kernel (``kernels/triton_paged_attention.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton_compat import gdc_launch_dependents, gdc_wait, pdl_launch
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl
from kernels.triton_paged_attention import (LOG2E, TritonAttentionPlan, attend_tile, block_pow2, check_query,
                                            dtype_choices, num_sms_of, output_gate)

MIN_SPLIT_TOKENS = 256  # a decode split below this many keys costs more in partial writes + reduce than it saves
MAX_SPLITS = 64
WAVES = 2  # decode aims at this many programs per SM


@dataclass(frozen=True, slots=True)
class DecodePrologue:
    """The qkv prologue (``kernels/triton_qkv_prologue.py``: q/k norm, rope, the KV write) done by the decode
    attention kernel itself; the query passed beside it is raw. One token per sequence."""

    key: torch.Tensor  # [B, KVH, D], raw (a view of the qkv projection)
    value: torch.Tensor  # [B, KVH, D]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    cos: torch.Tensor  # [B, 1, R]
    sin: torch.Tensor
    is_neox_style: bool
    slot_mapping: torch.Tensor  # [B]; < 0: nothing written


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Splits per sequence: enough (sequence, KV head, split) programs for WAVES waves over the SMs, but no split
    under MIN_SPLIT_TOKENS keys; 1 (no reduce kernel) when B * KVH already fills the GPU or contexts are short."""
    want = -(-WAVES * num_sms // max(1, num_seqs * num_kv_heads))
    cap = -(-max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(want, cap, MAX_SPLITS))


@_jit
def _normed_rotated(row_ptrs, row_ok, dims, head_dim, w_ptr, eps, cos_ptr, sin_ptr, cs_s1, rot,
                    HAS_NORM: tl.constexpr, IS_NEOX: tl.constexpr):
    """Heads (a row each, ``row_ptrs``) normed and rotated as ``_prologue_kernel`` does them, rounded where it
    rounds, in natural dim order: ``out[d] = x[d] cos[d] + x[pair(d)] sin[d]`` below ``rot`` (the tables carry the
    signs), the normed value above it."""
    d_ok = dims < head_dim
    mask = row_ok[:, None] & d_ok[None, :]
    rotated = dims < rot
    if IS_NEOX:
        pair = tl.where(dims < rot // 2, dims + rot // 2, dims - rot // 2)
    else:
        pair = dims ^ 1
    pair = tl.where(rotated, pair, dims)
    x = tl.load(row_ptrs[:, None] + dims[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    xp = tl.load(row_ptrs[:, None] + pair[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / head_dim + eps)
        w = tl.load(w_ptr + dims, mask=d_ok, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + pair, mask=d_ok, other=0.0).to(tl.float32)
        xf = (xf * rstd[:, None] * w[None, :]).to(x.dtype).to(tl.float32)
        xp = (xp * rstd[:, None] * wp[None, :]).to(x.dtype).to(tl.float32)
    c = tl.load(cos_ptr + dims * cs_s1, mask=rotated, other=1.0).to(tl.float32)
    sn = tl.load(sin_ptr + dims * cs_s1, mask=rotated, other=0.0).to(tl.float32)
    return (xf * c[None, :] + xp * sn[None, :]).to(x.dtype)


@_jit(do_not_specialize=['num_splits', 'stride_bt'])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_lse_ptr, gate_ptr,
    qk_scale, num_splits,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ob, stride_oh, stride_gb, stride_gh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr = False,
    kn_ptr=None, vn_ptr=None, qw_ptr=None, kw_ptr=None, cos_ptr=None, sin_ptr=None, slot_ptr=None, eps=0.0,
    stride_knb=0, stride_knh=0, stride_vnb=0, stride_vnh=0, cs_s0=0, cs_s1=0, rot=0,
    PROLOGUE: tl.constexpr = False, HAS_NORM: tl.constexpr = False, IS_NEOX: tl.constexpr = True,
):
    """PROLOGUE (``DecodePrologue``): q is raw; each program norms and rotates its heads' queries itself, and the
    program whose keys end at the new token takes that token's key and value from registers (normed, rotated,
    rounded to the cache dtype) and writes them to the cache: no prologue kernel, and no read of a key this program
    wrote."""
    if PDL:  # dependent launch (kernels/triton_compat.py): the kernel before finishes first
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kvh * GROUP + rows
    q_mask = row_ok[:, None] & dim_ok[None, :]
    if PROLOGUE:
        q = _normed_rotated(q_ptr + b * stride_qb + heads * stride_qh, row_ok, dims, HEAD_DIM, qw_ptr, eps,
                            cos_ptr + b * cs_s0, sin_ptr + b * cs_s0, cs_s1, rot, HAS_NORM, IS_NEOX)
    else:
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_kh
    holds_new = (seq_len - 1 >= start) & (seq_len - 1 < end)
    cached_end = end
    if PROLOGUE:
        cached_end = tl.where(holds_new, end - 1, end)  # the new token comes from registers, below
    for i in range(0, tl.cdiv(cached_end - start, BLOCK_N)):  # no iteration for an empty split (start >= seq_len)
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_base, v_base, bt_row, start + i * BLOCK_N, cached_end, rows, dims, dim_ok,
            stride_kb, stride_kt, qk_scale, BLOCK_SIZE, BLOCK_N, True, False, DOT_FP32, PRECISION,
        )
    if PROLOGUE:
        if holds_new:
            one = tl.arange(0, 1)
            k_new = _normed_rotated(kn_ptr + b * stride_knb + kvh * stride_knh + one * 0, one < 1, dims, HEAD_DIM,
                                    kw_ptr, eps, cos_ptr + b * cs_s0, sin_ptr + b * cs_s0, cs_s1, rot, HAS_NORM,
                                    IS_NEOX).to(k_ptr.dtype.element_ty)
            v_new = tl.load(vn_ptr + b * stride_vnb + kvh * stride_vnh + one[:, None] * 0 + dims[None, :],
                            mask=dim_ok[None, :], other=0.0).to(k_ptr.dtype.element_ty)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            if slot >= 0:
                at = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + dims[None, :]
                tl.store(k_base + at + one[:, None] * 0, k_new, mask=dim_ok[None, :])
                tl.store(v_base + at + one[:, None] * 0, v_new, mask=dim_ok[None, :])
            # one more online-softmax step, over the new key alone
            s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * qk_scale  # [G_PAD], log2 domain
            m_new = tl.maximum(m_i, s)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new)
            l_i = l_i * alpha + p
            p_in = p.to(v_new.dtype).to(tl.float32)  # rounded as attend_tile rounds p for its dot
            acc = acc * alpha[:, None] + p_in[:, None] * v_new.to(tl.float32)
            m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if DIRECT:
        if GATED:
            out = output_gate(out, gate_ptr + b * stride_gb + heads[:, None] * stride_gh + dims[None, :], q_mask,
                              out_ptr.dtype.element_ty)
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (b * GROUP * tl.num_programs(1) + heads) * num_splits + split  # [B, H, splits] row-major
        tl.store(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], out, mask=q_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@_jit(do_not_specialize=['num_splits'])
def _decode_reduce_kernel(
    part_acc_ptr, part_lse_ptr, out_ptr, gate_ptr, num_splits, stride_ob, stride_oh, stride_gb, stride_gh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr = False,
):
    """Combine one (sequence, head)'s split partials: weights 2^(lse_j - max lse); empty splits weigh 0."""
    if PDL:  # dependent launch (kernels/triton_compat.py): the kernel before finishes first
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, S_PAD)
    dims = tl.arange(0, D_PAD)
    base = (b * tl.num_programs(1) + h) * num_splits
    lse = tl.load(part_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty (seq_len >= 1): the max is finite
    used = lse > float("-inf")
    acc = tl.load(part_acc_ptr + (base + splits)[:, None] * D_PAD + dims[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w, 0)
    if GATED:
        out = output_gate(out, gate_ptr + b * stride_gb + h * stride_gh + dims, dims < HEAD_DIM,
                          out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)

def paged_decode_attention_triton(
    query: torch.Tensor,  # [B, H, D], one new token per sequence
    kv_cache_layer: torch.Tensor,  # [2, NB, BS, KVH, D]
    meta,
    scale: float,
    plan: TritonAttentionPlan | None = None,
    gate: torch.Tensor | None = None,  # [B, H, D], last dim contiguous
    prologue: DecodePrologue | None = None,
) -> torch.Tensor:  # [B, H, D]
    """Decode-only batch, split-KV (flash-decoding) with a reduce kernel when there is more than one split.
    ``gate``: the output is ``out * sigmoid(gate)`` (``output_gate``), applied where the output is stored.
    ``prologue``: ``query`` is raw, and the kernel norms, rotates and writes the new K/V itself (no prologue
    kernel before it)."""
    query, kvh, group, d = check_query(query, kv_cache_layer)
    if gate is not None and (gate.shape != query.shape or gate.stride(-1) != 1):
        raise ValueError(f"gate {tuple(gate.shape)} does not fit query {tuple(query.shape)} (last dim contiguous)")
    plan = plan if isinstance(plan, TritonAttentionPlan) else TritonAttentionPlan()
    B, H, _ = query.shape
    d_pad = block_pow2(d)
    block_n = block_pow2(plan.decode_block_n or (64 if d_pad <= 128 else 32))  # tl.dot needs >= 16
    splits = plan.num_splits or decode_num_splits(B, kvh, meta.max_seq_len, num_sms_of(query.device))
    out = torch.empty_like(query)
    direct = splits == 1
    part_acc = query.new_empty(0 if direct else B * H * splits * d_pad, dtype=torch.float32)
    part_lse = query.new_empty(0 if direct else B * H * splits, dtype=torch.float32)
    fp32, precision = dtype_choices(kv_cache_layer)
    k, v = kv_cache_layer[0], kv_cache_layer[1]
    g, g_strides = (gate, (gate.stride(0), gate.stride(1))) if gate is not None else (out, (0, 0))
    fused = _prologue_args(prologue, query) if prologue is not None else {}
    _decode_split_kernel[(B, kvh, splits)](
        query, k, v, meta.block_tables, meta.seq_lens, out, part_acc, part_lse, g, scale * LOG2E, splits,
        query.stride(0), query.stride(1), k.stride(0), k.stride(1), k.stride(2), meta.block_tables.stride(0),
        out.stride(0), out.stride(1), *g_strides,
        HEAD_DIM=d, D_PAD=d_pad, GROUP=group, G_PAD=block_pow2(group), BLOCK_SIZE=kv_cache_layer.shape[2],
        BLOCK_N=block_n, DIRECT=direct, DOT_FP32=fp32, PRECISION=precision, GATED=gate is not None, num_warps=4,
        num_stages=2, **fused, **pdl_launch(query),
    )
    if not direct:
        _decode_reduce_kernel[(B, H)](
            part_acc, part_lse, out, g, splits, out.stride(0), out.stride(1), *g_strides,
            HEAD_DIM=d, D_PAD=d_pad, S_PAD=block_pow2(splits, 2), GATED=gate is not None, num_warps=4,
            **pdl_launch(query),
        )
    return out


def _prologue_args(p: DecodePrologue, query: torch.Tensor) -> dict:
    B, H, D = query.shape
    if p.key.shape != (B, p.key.shape[1], D) or p.value.shape != p.key.shape or p.slot_mapping.shape != (B,):
        raise ValueError(f"prologue key {tuple(p.key.shape)} / value {tuple(p.value.shape)} / slots "
                         f"{tuple(p.slot_mapping.shape)} do not fit query {tuple(query.shape)}")
    if (p.q_norm is None) != (p.k_norm is None):
        raise ValueError("q and k are normed together or not at all")
    rot = p.cos.shape[-1]
    if rot % 2 or rot > D or p.cos.shape != p.sin.shape or p.cos.shape[0] != B:
        raise ValueError(f"bad cos/sin {tuple(p.cos.shape)} for query {tuple(query.shape)}")
    if p.key.stride(-1) != 1 or p.value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in their last dim")
    has_norm = p.q_norm is not None
    return dict(kn_ptr=p.key, vn_ptr=p.value, qw_ptr=p.q_norm if has_norm else query,
                kw_ptr=p.k_norm if has_norm else query, cos_ptr=p.cos, sin_ptr=p.sin,
                slot_ptr=p.slot_mapping.contiguous(), eps=float(p.eps), stride_knb=p.key.stride(0),
                stride_knh=p.key.stride(1), stride_vnb=p.value.stride(0), stride_vnh=p.value.stride(1),
                cs_s0=p.cos.stride(0), cs_s1=p.cos.stride(-1), rot=rot, PROLOGUE=True, HAS_NORM=has_norm,
                IS_NEOX=bool(p.is_neox_style))
