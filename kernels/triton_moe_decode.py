"""Fused MoE for decode-sized batches (a few dozen token slots): two GEMV-like Triton kernels, no expert grouping.

Semantics and the torch oracle are in ``kernels/moe.py`` (``fused_moe_ref``). At small ``T * k`` the grouped-GEMM
path (``kernels/triton_moe.py``) spends its time sorting slots by expert (a dozen small torch kernels) and in
BLOCK_M-row tiles holding one real row. Here every flat ``(token, j)`` slot (slot id ``token * k + j``) is its own
row:

1. ``_decode_gate_up_kernel``, grid (T*k slots, cdiv(I, BLOCK_N)): reads the slot's expert id (outside the local
   range: writes zeros), then streams x[token] and the expert's gate and up rows for its BLOCK_N outputs in
   BLOCK_K chunks along H (the contiguous dim of w13), multiplying elementwise into fp32 ``[BLOCK_N, BLOCK_K]``
   accumulators that are reduced once at the end; writes ``silu(gate) * up`` into ``h [T*k, I]`` (fp32);
2. ``_decode_down_kernel``, grid (T*k slots, cdiv(H, BLOCK_N)): ``h[slot] . w2[e, n]`` along I (the contiguous
   dim of w2) times the slot's routing weight, written in fp32 to ``out [T*k, H]`` (zeros for non-local slots, so
   ``out`` needs no memset);
3. the combine ``out.view(T, k, H).sum(1)`` in torch, cast to x's dtype.

No ``tl.dot`` (one row per program), so the interpreter runs it in any dtype. Grids depend only on T, k, H, I and
the block sizes, and nothing reads back to the host: CUDA-graph capturable. The intermediate stays fp32, so in
16-bit this path can differ from ``fused_moe_triton`` (which rounds ``h`` to x's dtype) by a few ulps.
Not done: tuned block sizes per shape, split-K for very small grids, a fused combine.
"""

from __future__ import annotations

import torch

from kernels.moe import check_kernel_inputs
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton

GATE_UP_BLOCKS = (16, 256)  # (BLOCK_N over I, BLOCK_K over H)
DOWN_BLOCKS = (32, 128)  # (BLOCK_N over H, BLOCK_K over I)


@_jit
def _decode_gate_up_kernel(
    x_ptr, w13_ptr, ids_ptr, h_ptr,
    TOP_K, H, I, x_s0, expert_offset, n_local,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """h[slot, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for this program's BLOCK_N columns."""
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + slot).to(tl.int64) - expert_offset
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    h_ptrs = h_ptr + slot.to(tl.int64) * I + offs_n
    if (e >= 0) & (e < n_local):
        tok = (slot // TOP_K).to(tl.int64)
        rows = tl.minimum(offs_n, I - 1).to(tl.int64)  # clamped: out-of-range columns are never stored
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + tok * x_s0 + offs_k
        g_ptrs = w13_ptr + e * 2 * I * H + rows[:, None] * H + offs_k[None, :]
        u_ptrs = g_ptrs + tl.cast(I, tl.int64) * H
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = k0 + offs_k < H
            xt = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            gt = tl.load(g_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
            ut = tl.load(u_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
            acc_g += gt * xt[None, :]
            acc_u += ut * xt[None, :]
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        g = tl.sum(acc_g, axis=1)
        u = tl.sum(acc_u, axis=1)
        # silu(g) = g * sigmoid(g); sigmoid from exp(-|g|) <= 1 so nothing overflows
        z = tl.exp(-tl.abs(g))
        sigmoid = tl.where(g >= 0, 1.0, z) / (1.0 + z)
        tl.store(h_ptrs, (g * sigmoid * u).to(h_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(h_ptrs, tl.zeros((BLOCK_N,), dtype=tl.float32).to(h_ptr.dtype.element_ty), mask=n_mask)


@_jit
def _decode_down_kernel(
    h_ptr, w2_ptr, ids_ptr, tw_ptr, out_ptr,
    H, I, expert_offset, n_local,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[slot, n] = topk_weight[slot] * (h[slot] . w2[e, n]) for this program's BLOCK_N columns."""
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + slot).to(tl.int64) - expert_offset
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    out_ptrs = out_ptr + slot.to(tl.int64) * H + offs_n
    if (e >= 0) & (e < n_local):
        rows = tl.minimum(offs_n, H - 1).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + slot.to(tl.int64) * I + offs_k
        w_ptrs = w2_ptr + e * H * I + rows[:, None] * I + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_mask = k0 + offs_k < I
            at = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            wt = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
            acc += wt * at[None, :]
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        rw = tl.load(tw_ptr + slot).to(tl.float32)
        tl.store(out_ptrs, tl.sum(acc, axis=1) * rw, mask=n_mask)
    else:
        tl.store(out_ptrs, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=n_mask)


def _check_blocks(blocks: tuple[int, int]) -> tuple[int, int]:
    bn, bk = blocks
    for b in (bn, bk):
        if b < 1 or b & (b - 1):
            raise ValueError(f"block sizes must be powers of two, got {blocks}")
    return bn, bk


def fused_moe_decode_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert_offset: int = 0, num_local_experts: int | None = None, *,
    gate_up_blocks: tuple[int, int] | None = None, down_blocks: tuple[int, int] | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Same contract as ``kernels.moe.fused_moe_ref``; meant for small ``T * k`` (decode). ``gate_up_blocks``
    ``(BLOCK_N over I, BLOCK_K over H)`` and ``down_blocks`` ``(BLOCK_N over H, BLOCK_K over I)`` override the
    defaults ``GATE_UP_BLOCKS`` / ``DOWN_BLOCKS`` (powers of two)."""
    t, h, n_local, inter, top_k = check_kernel_inputs(x, w13, w2, topk_weights, topk_ids, num_local_experts)
    if t == 0 or h == 0 or top_k == 0:
        return torch.zeros(t, h, dtype=x.dtype, device=x.device)
    bn1, bk1 = _check_blocks(gate_up_blocks or GATE_UP_BLOCKS)
    bn2, bk2 = _check_blocks(down_blocks or DOWN_BLOCKS)
    x = x if x.stride(1) == 1 else x.contiguous()
    n_slots = t * top_k
    ids = topk_ids.reshape(-1).contiguous()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(n_slots, inter, dtype=torch.float32, device=x.device)
    out = torch.empty(n_slots, h, dtype=torch.float32, device=x.device)  # every element is written
    _decode_gate_up_kernel[(n_slots, triton.cdiv(inter, bn1))](
        x, w13, ids, act, top_k, h, inter, x.stride(0), expert_offset, n_local,
        BLOCK_N=bn1, BLOCK_K=bk1, num_warps=num_warps,
    )
    _decode_down_kernel[(n_slots, triton.cdiv(h, bn2))](
        act, w2, ids, tw, out, h, inter, expert_offset, n_local,
        BLOCK_N=bn2, BLOCK_K=bk2, num_warps=num_warps,
    )
    return out.view(t, top_k, h).sum(1).to(x.dtype)
