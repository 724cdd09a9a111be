"""Fused mixture-of-experts as two grouped GEMMs over expert-sorted slots: Triton kernels.

Semantics and the torch oracle are in ``kernels/moe.py`` (``fused_moe_ref``). The flat ``(token, j)`` slots are
sorted by expert and padded per expert to a multiple of BLOCK_M (``moe.group_by_expert``, torch ops, no host sync;
up to MAX_SLOTS slots the one-program ``triton_moe_grouping.group_by_expert_triton``, same outputs).
Then:

1. ``_moe_gate_up_kernel``, grid (slot blocks, I tiles): each program takes BLOCK_M sorted slots of one expert,
   gathers their token rows of x, runs the gate and the up projection (two ``tl.dot`` accumulators in fp32) and
   writes ``silu(gate) * up`` into ``h [P, I]`` (x's dtype) at the sorted positions;
2. ``_moe_down_kernel``, grid (slot blocks, H tiles): ``h @ w2[e]^T`` times the slot's routing weight, stored
   in fp32 at the slot's row of ``out [T*k, H]``;
3. ``_combine_kernel``, grid (T, H tiles): the token's k rows of ``out`` summed in slot order (rows of slots
   routed to other ranks' experts skipped, so ``out`` needs no memset), cast to x's dtype.

FP8 experts (``Fp8Weight`` stacks, a scale grid per expert; kernels/fp8.py): each weight tile is converted to x's
dtype in registers (exact) for ``tl.dot`` and the tile's fp32 product scaled by its columns' scales before it joins
the accumulator; BLOCK_K then divides the scale block's width (the tables' 64 and 128 do for 128-wide blocks).

Blocks past the padded length (``block_expert == -1``) do nothing. Grids depend only on T, k, E and the block
sizes, and nothing reads back to the host, so the call is CUDA-graph capturable. In 16-bit the intermediate ``h``
is rounded to x's dtype (as vLLM does), so results can differ from the reference by a few ulps.
Decode-sized batches take the GEMV-like kernels of ``kernels/triton_moe_decode.py`` instead (``kernels.moe.fused_moe``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8 import Fp8Weight, scale_tile_limit
from kernels.moe import check_kernel_inputs, expert_weights, fp8_scale_args, group_by_expert
from kernels.triton_moe_grouping import MAX_EXPERTS, MAX_SLOTS, group_by_expert_triton
from kernels.triton_compat import INTERPRET  # interpreter: tl.dot on 16-bit inputs is wrong, use fp32
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton



@_jit(do_not_specialize=['N'])
def _moe_gate_up_kernel(
    x_ptr, w13_ptr, slots_ptr, block_expert_ptr, h_ptr,
    N, TOP_K, H, I, x_s0,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    s_ptr=None, s_e=0, s_r=0, scale_rows=1, scale_cols=1, scale_ncols=1, W_FP8: tl.constexpr = False,
):
    """h[pos, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for the BLOCK_M positions of one block.
    ``W_FP8``: w13 float8 with scales ``s_ptr`` [E, rows, cols] (strides ``s_e``, ``s_r``) per block of
    ``scale_rows`` x ``scale_cols``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(slots_ptr + offs_m)
        m_mask = slots < N
        tok = tl.where(m_mask, slots // TOP_K, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_n = tl.minimum(offs_n, I - 1).to(tl.int64)  # clamped: out-of-range columns are never stored
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + tok[:, None] * x_s0 + offs_k[None, :]
        g_ptrs = w13_ptr + e.to(tl.int64) * 2 * I * H + rows_n[:, None] * H + offs_k[None, :]
        u_ptrs = g_ptrs + I * H
        if W_FP8:
            sg_ptrs = s_ptr + e.to(tl.int64) * s_e + (rows_n // scale_rows) * s_r
            su_ptrs = s_ptr + e.to(tl.int64) * s_e + ((rows_n + I) // scale_rows) * s_r
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = (k0 + offs_k < H)[None, :]
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask, other=0.0)
            gt = tl.load(g_ptrs, mask=k_mask, other=0.0)
            ut = tl.load(u_ptrs, mask=k_mask, other=0.0)
            if W_FP8:  # each tile's product scaled by its columns' scales (BLOCK_K within one scale column)
                sg = tl.load(sg_ptrs + k0 // scale_cols)
                su = tl.load(su_ptrs + k0 // scale_cols)
                if DOT_FP32:
                    xt = xt.to(tl.float32)
                    acc_g += tl.dot(xt, tl.trans(gt.to(tl.float32)), input_precision="ieee") * sg[None, :]
                    acc_u += tl.dot(xt, tl.trans(ut.to(tl.float32)), input_precision="ieee") * su[None, :]
                else:
                    acc_g += tl.dot(xt, tl.trans(gt.to(xt.dtype))) * sg[None, :]
                    acc_u += tl.dot(xt, tl.trans(ut.to(xt.dtype))) * su[None, :]
            elif DOT_FP32:
                xt = xt.to(tl.float32)
                acc_g = tl.dot(xt, tl.trans(gt.to(tl.float32)), acc_g, input_precision="ieee")
                acc_u = tl.dot(xt, tl.trans(ut.to(tl.float32)), acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(xt, tl.trans(gt), acc_g)
                acc_u = tl.dot(xt, tl.trans(ut), acc_u)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        # silu(g) = g * sigmoid(g); sigmoid from exp(-|g|) <= 1 so nothing overflows
        z = tl.exp(-tl.abs(acc_g))
        sigmoid = tl.where(acc_g >= 0, 1.0, z) / (1.0 + z)
        act = acc_g * sigmoid * acc_u
        h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * I + offs_n[None, :]
        tl.store(h_ptrs, act.to(h_ptr.dtype.element_ty), mask=(offs_n < I)[None, :])


@_jit(do_not_specialize=['N'])
def _moe_down_kernel(
    h_ptr, w2_ptr, slots_ptr, block_expert_ptr, tw_ptr, out_ptr,
    N, H, I,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    s_ptr=None, s_e=0, s_r=0, scale_rows=1, scale_cols=1, scale_ncols=1, W_FP8: tl.constexpr = False,
):
    """out[slot, n] = topk_weight[slot] * (h[pos] . w2[e, n]) for the BLOCK_M positions of one block. ``W_FP8``:
    w2 float8 with scales as in ``_moe_gate_up_kernel``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(slots_ptr + offs_m)
        m_mask = slots < N
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_n = tl.minimum(offs_n, H - 1).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * I + offs_k[None, :]
        w_ptrs = w2_ptr + e.to(tl.int64) * H * I + rows_n[:, None] * I + offs_k[None, :]
        if W_FP8:
            s_ptrs = s_ptr + e.to(tl.int64) * s_e + (rows_n // scale_rows) * s_r
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_mask = (k0 + offs_k < I)[None, :]
            at = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask, other=0.0)
            wt = tl.load(w_ptrs, mask=k_mask, other=0.0)
            if W_FP8:
                sw = tl.load(s_ptrs + k0 // scale_cols)
                if DOT_FP32:
                    acc += tl.dot(at.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee") * sw[None, :]
                else:
                    acc += tl.dot(at, tl.trans(wt.to(at.dtype))) * sw[None, :]
            elif DOT_FP32:
                acc = tl.dot(at.to(tl.float32), tl.trans(wt.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(at, tl.trans(wt), acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        rw = tl.load(tw_ptr + slots, mask=m_mask, other=0.0)
        acc = acc * rw[:, None]
        out_ptrs = out_ptr + slots.to(tl.int64)[:, None] * H + offs_n[None, :]
        tl.store(out_ptrs, acc, mask=m_mask[:, None] & (offs_n < H)[None, :])


@_jit
def _combine_kernel(out_ptr, ids_ptr, y_ptr, TOP_K, H, y_s0, expert_offset, n_local, BLOCK_H: tl.constexpr):
    """y[tok] = sum over the token's k slots in order of out[slot], skipping slots of non-local experts (their
    rows of ``out`` were never written), cast to y's dtype: no memset of ``out`` and one pass over it."""
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(0, TOP_K):
        slot = tok * TOP_K + j
        e = tl.load(ids_ptr + slot) - expert_offset
        if (e >= 0) & (e < n_local):
            acc += tl.load(out_ptr + slot * H + offs, mask=mask, other=0.0)
    tl.store(y_ptr + tok * y_s0 + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class GroupedConfig:
    """Launch parameters of the grouped path: BLOCK_M (slots per block, the grouping's padding unit) and, per
    kernel, (BLOCK_N, BLOCK_K, num_warps, num_stages). Block sizes are powers of two >= 16."""

    block_m: int
    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


# By average slots per local expert (T * k / E), the smallest bucket that holds it; from a bench/moe_tune.py sweep on
# the Qwen3-30B-A3B expert shape (H 2048, I 768, 128 experts).
GROUPED_CONFIGS: tuple[tuple[int, GroupedConfig], ...] = (
    (1, GroupedConfig(16, (128, 128, 4, 3), (64, 128, 4, 3))),
    (4, GroupedConfig(16, (64, 128, 4, 3), (64, 128, 4, 3))),
    (16, GroupedConfig(32, (64, 128, 4, 3), (64, 128, 4, 3))),
    (64, GroupedConfig(64, (64, 64, 4, 3), (128, 64, 4, 4))),
    (1 << 62, GroupedConfig(128, (128, 64, 8, 3), (128, 64, 4, 3))),
)


def grouped_config(num_tokens: int, top_k: int, num_experts: int) -> GroupedConfig:
    per_expert = num_tokens * top_k / max(1, num_experts)
    return next(config for bound, config in GROUPED_CONFIGS if per_expert <= bound)


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, expert_offset: int = 0, num_local_experts: int | None = None, *,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.moe.fused_moe_ref``; ``config`` overrides the table (``grouped_config``). FP8
    stacks (``Fp8Weight``) cap the table's BLOCK_K at ``scale_tile_limit`` (an override must respect it)."""
    t, h, n_local, inter, top_k = check_kernel_inputs(x, w13, w2, topk_weights, topk_ids, num_local_experts)
    if t == 0 or h == 0 or top_k == 0:
        return torch.zeros(t, h, dtype=x.dtype, device=x.device)
    (w13, s13, b13), (w2, s2, b2) = expert_weights(w13), expert_weights(w2)
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or grouped_config(t, top_k, n_local)
    bm, (bn1, bk1, warps1, stages1), (bn2, bk2, warps2, stages2) = cfg.block_m, cfg.gate_up, cfg.down
    if x.dtype == torch.float32 and config is None:  # the table is for 16-bit tiles: fp32 halves what fits
        bk1, bk2 = min(bk1, 32), min(bk2, 32)
    if config is None:
        bk1 = bk1 if b13 is None else min(bk1, scale_tile_limit(b13[1], h))
        bk2 = bk2 if b2 is None else min(bk2, scale_tile_limit(b2[1], inter))
    for b in (bm, bn1, bk1, bn2, bk2):
        if b < 16 or b & (b - 1):
            raise ValueError(f"block sizes must be powers of two >= 16, got {cfg}")
    for block, bk, k in ((b13, bk1, h), (b2, bk2, inter)):
        if block is not None and bk > scale_tile_limit(block[1], k):
            raise ValueError(f"BLOCK_K {bk} spans two {block[1]}-wide scale columns")
    if topk_ids.numel() <= MAX_SLOTS and n_local <= MAX_EXPERTS:  # decode-sized: one program, not a dozen kernels
        sorted_slots, block_expert, _ = group_by_expert_triton(topk_ids, n_local, bm, expert_offset)
    else:
        sorted_slots, block_expert, _ = group_by_expert(topk_ids, n_local, bm, expert_offset)
    n_slots = t * top_k
    n_blocks = block_expert.numel()
    dot_fp32 = INTERPRET or x.dtype == torch.float32
    act = torch.empty(sorted_slots.numel(), inter, dtype=x.dtype, device=x.device)
    out = torch.empty(n_slots, h, dtype=torch.float32, device=x.device)  # rows of non-local slots stay unread
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    _moe_gate_up_kernel[(n_blocks, triton.cdiv(inter, bn1))](
        x, w13, sorted_slots, block_expert, act, n_slots, top_k, h, inter, x.stride(0),
        DOT_FP32=dot_fp32, BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1, num_warps=warps1, num_stages=stages1,
        **fp8_scale_args(s13, b13),
    )
    _moe_down_kernel[(n_blocks, triton.cdiv(h, bn2))](
        act, w2, sorted_slots, block_expert, tw, out, n_slots, h, inter,
        DOT_FP32=dot_fp32, BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2, num_warps=warps2, num_stages=stages2,
        **fp8_scale_args(s2, b2),
    )
    y = torch.empty(t, h, dtype=x.dtype, device=x.device)
    block_h = min(1024, triton.next_power_of_2(h))
    _combine_kernel[(t, triton.cdiv(h, block_h))](
        out, ids, y, top_k, h, y.stride(0), expert_offset, n_local, BLOCK_H=block_h, num_warps=4)
    return y
