"""Fused MoE for decode-sized batches (a few dozen token slots): two GEMV-like Triton kernels, no expert grouping.

Semantics and the torch oracle are in ``kernels/moe.py`` (``fused_moe_ref``). At small ``T * k`` the grouped-GEMM
path (``kernels/triton_moe.py``) spends its time sorting slots by expert (a dozen small torch kernels) and in
BLOCK_M-row tiles holding one real row. Here every flat ``(token, j)`` slot (slot id ``token * k + j``) is its own
row:

1. ``_decode_gate_up_kernel``, grid (T*k slots, cdiv(I, BLOCK_N)): reads the slot's expert id (outside the local
   range: writes zeros), then streams x[token] and the expert's gate and up rows for its BLOCK_N outputs in
   BLOCK_K chunks along H (the contiguous dim of w13), multiplying elementwise into fp32 ``[BLOCK_N, BLOCK_K]``
   accumulators that are reduced once at the end; writes ``silu(gate) * up`` into ``h [T*k, I]`` (fp32);
2. ``_decode_down_kernel``, grid (T, cdiv(H, BLOCK_N)): the token's k slots side by side, ``h[slot] . w2[e, n]``
   along I (the contiguous dim of w2) times the slot's routing weight, summed in fp32 and stored once in x's
   dtype: the combine is fused, so no ``[T*k, H]`` buffer, sum or cast kernel follows.

FP8 experts (``Fp8Weight`` stacks, a scale grid per expert; kernels/fp8.py): each weight tile is converted in
registers and scaled by its rows' scales for that K tile before its products, so a weight is read as one byte; BLOCK_K
then divides the scale block's width (at most 128 for 128-wide blocks; the gate/up loop takes several such tiles a
step, the down tile more rows, so the programs keep their bytes in flight).

No ``tl.dot`` (one row per program), so the interpreter runs it in any dtype. Grids depend only on T, k, H, I and
the block sizes, and nothing reads back to the host: CUDA-graph capturable. The intermediate stays fp32, so in
16-bit this path can differ from ``fused_moe_triton`` (which rounds ``h`` to x's dtype) by a few ulps.
Block sizes and warps come from H200 sweeps on the Qwen3-30B-A3B and Qwen3.5-35B-A3B expert shapes
(``bench/moe_tune.py``).
"""

from __future__ import annotations

import torch

from kernels.fp8 import Fp8Weight, scale_tile_limit
from kernels.moe import check_kernel_inputs, expert_weights, fp8_scale_args
from kernels.triton_compat import EARLY_LOADS, pdl_launch, pdl_wait
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton

# By token count, the smallest bucket that holds T: ((BLOCK_N over I, BLOCK_K over H, num_warps[, stages]) of
# gate/up, (BLOCK_N over H, BLOCK_K over I, num_warps) of down); from H200 sweeps (bench/moe_tune.py; at one token,
# bench/b1_ablation.py inside the decode step). ``stages``: weight tiles in flight a gate/up program along H
# (``tl.range``'s num_stages copies the later tiles into shared memory ahead of their use, so the registers, and the
# programs an SM holds, stay as at one stage; 1 when left out). The down kernel
# holds a [K_PAD, BLOCK_N, BLOCK_K] fp32 tile, so its table depends on the padded slots a token has: up to 8
# (Qwen3-30B-A3B: 8 of 768-wide experts) or 9-16 (Qwen3.5: 8 routed + the folded shared expert, 512 wide; there
# the 8-slot table's down tiles spill registers and run 10x slower, results/moe-tune-decode-h200-qwen3.5-35b-a3b.json).
DECODE_CONFIGS: dict[int, tuple[tuple[int, tuple[int, ...], tuple[int, int, int]], ...]] = {
    8: (
        (1, (16, 128, 8, 3), (4, 128, 8)),
        (2, (8, 128, 8), (16, 128, 4)),
        (4, (16, 256, 2), (16, 128, 4)),
        (1 << 62, (32, 128, 2), (16, 128, 4)),
    ),
    16: (
        (1, (8, 256, 8), (2, 64, 4)),
        (4, (8, 128, 4), (16, 64, 4)),
        (1 << 62, (8, 256, 8), (16, 64, 4)),
    ),
}
DOWN_TILE_LIMIT = 128  # fp32 accumulator elements a thread in the down kernel's tile, at most (256 spilled)


def decode_config(num_tokens: int, top_k: int = 8) -> tuple[tuple[int, ...], tuple[int, int, int]]:
    """The launch configs for T tokens of ``top_k`` slots (k > 16 takes the 16-slot table's tiles, shrunk
    until the down tile fits ``DOWN_TILE_LIMIT`` elements a thread)."""
    k_pad = triton.next_power_of_2(top_k)
    table = DECODE_CONFIGS[8 if k_pad <= 8 else 16]
    gate_up, (bn, bk, warps) = next((g, d) for bound, g, d in table if num_tokens <= bound)
    while k_pad * bn * bk > DOWN_TILE_LIMIT * 32 * warps and bn > 1:
        bn //= 2
    while k_pad * bn * bk > DOWN_TILE_LIMIT * 32 * warps and bk > 16:
        bk //= 2
    return gate_up, (bn, bk, warps)


@_jit
def _decode_gate_up_kernel(
    x_ptr, w13_ptr, ids_ptr, h_ptr,
    TOP_K, H, I, x_s0, expert_offset, n_local,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False,
    LATE_TRIGGER: tl.constexpr = False,
    s_ptr=None, s_e=0, s_r=0, scale_rows=1, scale_cols=1, scale_ncols=1, W_FP8: tl.constexpr = False,
    K_SUB: tl.constexpr = 1,
):
    """h[slot, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for this program's BLOCK_N columns.
    ``LATE_TRIGGER``: the down kernel launches once the routing is done (it reads the routing before its wait).
    ``W_FP8``: w13 is float8 with scales ``s_ptr`` [E, rows, scale_ncols] (strides ``s_e``, ``s_r``) per block of
    ``scale_rows`` x ``scale_cols``. A loop step takes K_SUB tiles of BLOCK_K (FP8: BLOCK_K within a scale column,
    the step as wide as the 16-bit tile)."""
    pdl_wait(PDL, LATE_TRIGGER)  # dependent launch: kernels/triton_compat.py
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
        if W_FP8:
            sg_ptrs = s_ptr + e * s_e + (rows // scale_rows) * s_r
            su_ptrs = s_ptr + e * s_e + ((rows + I) // scale_rows) * s_r
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K * K_SUB, num_stages=STAGES):
            for j in tl.static_range(K_SUB):
                kk = k0 + j * BLOCK_K
                k_mask = kk + offs_k < H
                xt = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
                gt = tl.load(g_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
                ut = tl.load(u_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
                if W_FP8:  # the rows' scales for this K tile (clamped: a tile past H is zeros)
                    col = tl.minimum(kk // scale_cols, scale_ncols - 1)
                    gt = gt * tl.load(sg_ptrs + col)[:, None]
                    ut = ut * tl.load(su_ptrs + col)[:, None]
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
    h_ptr, w2_ptr, ids_ptr, tw_ptr, y_ptr,
    TOP_K, H, I, y_s0, expert_offset, n_local,
    K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    s_ptr=None, s_e=0, s_r=0, scale_rows=1, scale_cols=1, scale_ncols=1, W_FP8: tl.constexpr = False,
):
    """y[tok, n] = sum_j topk_weight[tok, j] * (h[tok * k + j] . w2[e_j, n]) for this program's BLOCK_N columns:
    the down projection and the combine in one pass. The token's k experts are loaded side by side as one
    [K_PAD, BLOCK_N, BLOCK_K] tile per step (not one expert after another), so a program has k experts' bytes in
    flight; the sum over experts happens once, in a fixed order (deterministic). ``W_FP8``: w2 float8 with scales as
    in ``_decode_gate_up_kernel``."""
    if not EARLY:
        pdl_wait(PDL)  # dependent launch: kernels/triton_compat.py
    tok = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    # With EARLY (the gate/up kernel launched this one only after its own wait, so the routing is done): the
    # routing and the first weight tile are read before the wait, overlapping the gate/up kernel's tail.
    offs_j = tl.arange(0, K_PAD)
    slots = tok * TOP_K + offs_j
    e = tl.load(ids_ptr + slots, mask=offs_j < TOP_K, other=0).to(tl.int64) - expert_offset
    local = (offs_j < TOP_K) & (e >= 0) & (e < n_local)  # slots routed to another rank's experts add nothing
    e = tl.where(local, e, 0)
    rw = tl.load(tw_ptr + slots, mask=local, other=0.0).to(tl.float32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, H - 1).to(tl.int64)  # clamped: out-of-range columns are never stored
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w2_ptr + (e * H * I)[:, None, None] + (rows * I)[None, :, None] + offs_k[None, None, :]
    k_mask = offs_k < I
    w0 = tl.load(w_ptrs, mask=local[:, None, None] & k_mask[None, None, :], other=0.0)
    if W_FP8:  # [K_PAD, BLOCK_N] scales of the slots' experts' rows; a weight, so readable before the wait
        s_ptrs = s_ptr + (e * s_e)[:, None] + ((rows // scale_rows) * s_r)[None, :]
        w0 = w0.to(tl.float32) * tl.load(s_ptrs)[:, :, None]
    if EARLY:
        pdl_wait(PDL)
    a_ptrs = h_ptr + slots[:, None] * I + offs_k[None, :]
    a0 = tl.load(a_ptrs, mask=local[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    acc = w0.to(tl.float32) * a0[:, None, :]
    for k0 in range(BLOCK_K, I, BLOCK_K):
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        k_mask = k0 + offs_k < I
        a_k = tl.load(a_ptrs, mask=local[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w_k = tl.load(w_ptrs, mask=local[:, None, None] & k_mask[None, None, :], other=0.0).to(tl.float32)
        if W_FP8:
            w_k = w_k * tl.load(s_ptrs + k0 // scale_cols)[:, :, None]
        acc += w_k * a_k[:, None, :]
    y = tl.sum(tl.sum(acc, axis=2) * rw[:, None], axis=0)
    tl.store(y_ptr + tok * y_s0 + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < H)


def _check_config(config: tuple[int, ...], stages: bool = False) -> tuple[int, ...]:
    """``(block, block, warps)`` (powers of two), with ``stages`` allowed an optional fourth entry (>= 1), given
    back as four entries."""
    if len(config) not in ((3, 4) if stages else (3,)) or any(b < 1 for b in config):
        raise ValueError(f"need (block_n, block_k, num_warps{'[, stages]' if stages else ''}), got {config}")
    for b in config[:3]:
        if b & (b - 1):
            raise ValueError(f"block sizes and warps must be powers of two, got {config}")
    return (*config, 1) if stages and len(config) == 3 else config


def fused_moe_decode_triton(
    x: torch.Tensor, w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, expert_offset: int = 0, num_local_experts: int | None = None, *,
    gate_up_config: tuple[int, ...] | None = None, down_config: tuple[int, int, int] | None = None,
    gate_up_k_sub: int | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.moe.fused_moe_ref``; meant for small ``T * k`` (decode). ``gate_up_config``
    ``(BLOCK_N over I, BLOCK_K over H, num_warps[, stages])`` and ``down_config`` ``(BLOCK_N over H, BLOCK_K over I,
    num_warps)`` override the table (``decode_config``; blocks and warps powers of two). ``w13`` / ``w2`` may be
    FP8 stacks (``Fp8Weight``): a config's BLOCK_K is then capped to stay in one scale column, the gate/up loop step
    kept as wide by taking several K tiles a step (``gate_up_k_sub`` overrides how many), the down tile by more
    rows."""
    t, h, n_local, inter, top_k = check_kernel_inputs(x, w13, w2, topk_weights, topk_ids, num_local_experts)
    if t == 0 or h == 0 or top_k == 0:
        return torch.zeros(t, h, dtype=x.dtype, device=x.device)
    (w13, s13, b13), (w2, s2, b2) = expert_weights(w13), expert_weights(w2)
    default_gate_up, default_down = decode_config(t, top_k)
    gate_up, sub1 = _stepped(_check_config(gate_up_config or default_gate_up, stages=True), s13, b13, h)
    bn1, bk1, warps1, stages1 = gate_up
    sub1 = gate_up_k_sub or sub1
    if sub1 < 1:
        raise ValueError(f"gate_up_k_sub must be >= 1, got {sub1}")
    bn2, bk2, warps2 = _capped(_check_config(down_config or default_down), s2, b2, inter)
    x = x if x.stride(1) == 1 else x.contiguous()
    n_slots = t * top_k
    ids = topk_ids.reshape(-1).contiguous()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(n_slots, inter, dtype=torch.float32, device=x.device)
    pdl = pdl_launch(x)
    early = bool(pdl) and EARLY_LOADS
    y = torch.empty(t, h, dtype=x.dtype, device=x.device)  # every element is written
    _decode_gate_up_kernel[(n_slots, triton.cdiv(inter, bn1))](
        x, w13, ids, act, top_k, h, inter, x.stride(0), expert_offset, n_local,
        BLOCK_N=bn1, BLOCK_K=bk1, STAGES=stages1, num_warps=warps1, LATE_TRIGGER=early, **pdl,
        **fp8_scale_args(s13, b13), **({"K_SUB": sub1} if sub1 > 1 else {}),
    )
    _decode_down_kernel[(t, triton.cdiv(h, bn2))](
        act, w2, ids, tw, y, top_k, h, inter, y.stride(0), expert_offset, n_local,
        K_PAD=triton.next_power_of_2(top_k), BLOCK_N=bn2, BLOCK_K=bk2, num_warps=warps2, EARLY=early, **pdl,
        **fp8_scale_args(s2, b2),
    )
    return y


def _stepped(config: tuple[int, ...], scale: torch.Tensor | None, block: tuple[int, int] | None,
             k: int) -> tuple[tuple[int, ...], int]:
    """A gate/up config for FP8 weights and its K tiles a step: BLOCK_K at most ``scale_tile_limit``, the
    loop step as wide as the table's tile (the same programs, half the bytes each against 16 bits)."""
    if scale is None or block is None:
        return config, 1
    bn, bk, *rest = config
    limit = scale_tile_limit(block[1], k)
    sub = 1
    while bk > limit and bk > 1:
        bk, sub = bk // 2, sub * 2
    return (bn, bk, *rest), sub


def _capped(config: tuple[int, ...], scale: torch.Tensor | None, block: tuple[int, int] | None,
            k: int) -> tuple[int, ...]:
    """A down config for FP8 weights: BLOCK_K at most ``scale_tile_limit``, BLOCK_N raised by the same factor (the
    tile keeps its elements; its bytes halve against 16 bits)."""
    if scale is None or block is None:
        return config
    bn, bk, *rest = config
    limit = scale_tile_limit(block[1], k)
    while bk > limit and bk > 1:
        bk, bn = bk // 2, bn * 2
    return (bn, bk, *rest)
