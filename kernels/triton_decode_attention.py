"""Decode attention over the paged cache (one new token per sequence): flash-decoding in Triton, same contract
as ``kernels.paged_attention`` for decode-only steps.

Grid ``(B, KVH, num_splits)``; the query heads of a KV head are the rows of the Q tile (padded to 16 for
``tl.dot``). Each sequence's context is cut on the device into ``num_splits`` equal parts (rounded up to BLOCK_N),
each part writes a normalized partial output and its log-sum-exp, and a small reduce kernel combines them.
``decode_num_splits`` picks the count from the batch shape; with one split the kernel writes the output directly
and no reduce runs. The key tile step, the output gate and the plan are
shared with the prefill kernel (``kernels/triton_paged_attention.py``).
"""

from __future__ import annotations

import torch

from kernels.triton_compat import EARLY_LOADS, pdl_launch, pdl_wait
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl
from kernels.triton_paged_attention import (LOG2E, TritonAttentionPlan, attend_tile, block_pow2, check_query,
                                            dtype_choices, num_sms_of, output_gate, split_reduce_kernel)

MIN_SPLIT_TOKENS = 256  # a decode split below this many keys costs more in partial writes + reduce than it saves
MAX_SPLITS = 128  # H200, Qwen3.5-35B-A3B B1 after 32k tokens: 333.4 tok/s with 64, 350.9 with 128 (2 KV heads)
WAVES = 2  # decode aims at this many programs per SM


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Splits per sequence: enough (sequence, KV head, split) programs for WAVES waves over the SMs, but no split
    under MIN_SPLIT_TOKENS keys; 1 (no reduce kernel) when B * KVH already fills the GPU or contexts are short."""
    want = -(-WAVES * num_sms // max(1, num_seqs * num_kv_heads))
    cap = -(-max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(want, cap, MAX_SPLITS))


@_jit(do_not_specialize=['num_splits', 'stride_bt'])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_lse_ptr, gate_ptr,
    qk_scale, num_splits,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ob, stride_oh, stride_gb, stride_gh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr = False,
    EARLY: tl.constexpr = True,
):
    if not EARLY:
        pdl_wait(PDL)  # dependent launch: kernels/triton_compat.py
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
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_kh

    # The split's first key tile. Every key but the step's own (position seq_len - 1, which the prologue kernel
    # writes) was written by an earlier step, and the block table and lengths by host copies before it: all of it
    # may be read before the wait, overlapping the kernels this one waits on.
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
    kv_off = (blk.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt)[:, None] + dims[None, :]
    old = (n_ok & (offs_n < seq_len - 1))[:, None] & dim_ok[None, :]
    k = tl.load(k_base + kv_off, mask=old, other=0.0)
    v = tl.load(v_base + kv_off, mask=old, other=0.0)
    if EARLY:
        pdl_wait(PDL)
    new = (offs_n == seq_len - 1)[:, None] & dim_ok[None, :]  # the step's own key, if it falls in this tile
    k = tl.where(new, tl.load(k_base + kv_off, mask=new, other=0.0), k)
    v = tl.where(new, tl.load(v_base + kv_off, mask=new, other=0.0), v)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    if start < end:  # an empty split (start >= seq_len) has no tile
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_i = tl.max(s, 1)
        p = tl.exp2(s - m_i[:, None])
        l_i = tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    for i in range(1, tl.cdiv(end - start, BLOCK_N)):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_base, v_base, bt_row, start + i * BLOCK_N, end, rows, dims, dim_ok,
            stride_kb, stride_kt, qk_scale, BLOCK_SIZE, BLOCK_N, True, False, DOT_FP32, PRECISION,
        )
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


def paged_decode_attention_triton(
    query: torch.Tensor,  # [B, H, D], one new token per sequence
    kv_cache_layer: torch.Tensor,  # [2, NB, BS, KVH, D]
    meta,
    scale: float,
    plan: TritonAttentionPlan | None = None,
    gate: torch.Tensor | None = None,  # [B, H, D], last dim contiguous
) -> torch.Tensor:  # [B, H, D]
    """Decode-only batch, split-KV (flash-decoding) with a reduce kernel when there is more than one split.
    ``gate``: the output is ``out * sigmoid(gate)`` (``output_gate``), applied where the output is stored."""
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
    _decode_split_kernel[(B, kvh, splits)](
        query, k, v, meta.block_tables, meta.seq_lens, out, part_acc, part_lse, g, scale * LOG2E, splits,
        query.stride(0), query.stride(1), k.stride(0), k.stride(1), k.stride(2), meta.block_tables.stride(0),
        out.stride(0), out.stride(1), *g_strides,
        HEAD_DIM=d, D_PAD=d_pad, GROUP=group, G_PAD=block_pow2(group), BLOCK_SIZE=kv_cache_layer.shape[2],
        BLOCK_N=block_n, DIRECT=direct, DOT_FP32=fp32, PRECISION=precision, GATED=gate is not None, num_warps=4,
        num_stages=2, EARLY=EARLY_LOADS, **pdl_launch(query),
    )
    if not direct:
        split_reduce_kernel[(B, H)](
            part_acc, part_lse, out, g, splits, out.stride(0), out.stride(1), *g_strides,
            HEAD_DIM=d, D_PAD=d_pad, S_PAD=block_pow2(splits, 2), GATED=gate is not None,
            num_warps=8 if block_pow2(splits, 2) * d_pad > 16384 else 4,  # the partials tile: <= 128 fp32 a thread
            **pdl_launch(query),
        )
    return out

