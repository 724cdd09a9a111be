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
Block sizes and warps come from sweeps on the Qwen3-30B-A3B and Qwen3.5-35B-A3B expert shapes
(``bench/moe_tune.py``).
"""

from __future__ import annotations

import torch

from kernels.fp8 import Fp8Weight, scale_tile_limit
from kernels.moe import check_kernel_inputs, expert_weights, fp8_scale_args
from kernels.triton_compat import pdl_launch, pdl_wait
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton

# By token count, the smallest bucket that holds T: ((BLOCK_N over I, BLOCK_K over H, num_warps[, stages]) of
# gate/up, (BLOCK_N over H, BLOCK_K over I, num_warps) of down); from sweeps of bench/moe_tune.py. ``stages``: weight
# tiles in flight a gate/up program along H (``tl.range``'s num_stages copies the later tiles into shared memory ahead
# of their use, so the registers, and the programs an SM holds, stay as at one stage; 1 when left out). The down
# kernel holds a [K_PAD, BLOCK_N, BLOCK_K] fp32 tile, so its table depends on the padded slots a token has: up to 8
# (Qwen3-30B-A3B: 8 of 768-wide experts) or 9-16 (Qwen3.5: 8 routed + the folded shared expert, 512 wide; there
# the 8-slot table's down tiles spill registers, bench/results/moe-tune-decode-*.json).
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
    K_SUB: tl.constexpr = 1, SC: tl.constexpr = 1,
):
    """h[slot, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]) for this program's BLOCK_N columns.
    ``LATE_TRIGGER``: the down kernel launches once the routing is done (it reads the routing before its wait).
    A loop step takes K_SUB tiles of BLOCK_K. ``W_FP8``: w13 is float8 with scales ``s_ptr`` [E, rows,
    scale_ncols] (strides ``s_e``, ``s_r``) per block of ``scale_rows`` x ``scale_cols``; BLOCK_N divides
    ``scale_rows`` and I, so a program's gate rows share one scale row and its up rows another, and a K tile is
    BLOCK_K // SC chunks of SC columns, each inside one scale column: the chunk's scale multiplies x's columns under
    it (a multiplication per activation, not per weight), so tiles span several scale columns and keep the 16-bit
    tile's bytes."""
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
        if W_FP8:
            g, u = _fp8_gate_up_sums(x_ptr + tok * x_s0, w13_ptr + e * 2 * I * H, s_ptr + e * s_e, rows,
                                     pid_n * BLOCK_N, H, I, s_r, scale_rows, scale_cols, scale_ncols, BLOCK_N,
                                     BLOCK_K, SC, K_SUB, STAGES)
        else:
            offs_k = tl.arange(0, BLOCK_K)
            x_ptrs = x_ptr + tok * x_s0 + offs_k
            g_ptrs = w13_ptr + e * 2 * I * H + rows[:, None] * H + offs_k[None, :]
            u_ptrs = g_ptrs + tl.cast(I, tl.int64) * H
            acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in tl.range(0, H, BLOCK_K * K_SUB, num_stages=STAGES):
                for j in tl.static_range(K_SUB):
                    kk = k0 + j * BLOCK_K
                    k_mask = kk + offs_k < H
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
def _fp8_gate_up_sums(x_ptr, w_ptr, s_ptr, rows, row0, H, I, s_r, scale_rows, scale_cols, scale_ncols,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SC: tl.constexpr, K_SUB: tl.constexpr,
                      STAGES: tl.constexpr):
    """The gate and up sums of one slot's FP8 expert (``w_ptr``, ``s_ptr``: its weights and scales) for rows
    ``rows`` (from ``row0``): [BLOCK_N, G, SC] tiles, x's [G, SC] tile scaled by the gate rows' and by the up rows'
    scale for each chunk's scale column (clamped: a chunk past H is masked to zeros)."""
    G: tl.constexpr = BLOCK_K // SC
    offs_g = tl.arange(0, G)
    offs_gc = offs_g[:, None] * SC + tl.arange(0, SC)[None, :]
    x_ptrs = x_ptr + offs_gc
    g_ptrs = w_ptr + rows[:, None, None] * H + offs_gc[None, :, :]
    u_ptrs = g_ptrs + tl.cast(I, tl.int64) * H
    sg_row = s_ptr + (row0 // scale_rows) * s_r
    su_row = s_ptr + ((row0 + I) // scale_rows) * s_r
    acc_g = tl.zeros((BLOCK_N, G, SC), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, G, SC), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K * K_SUB, num_stages=STAGES):
        for j in tl.static_range(K_SUB):
            kk = k0 + j * BLOCK_K
            k_mask = kk + offs_gc < H
            xt = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            gt = tl.load(g_ptrs, mask=k_mask[None, :, :], other=0.0).to(tl.float32)
            ut = tl.load(u_ptrs, mask=k_mask[None, :, :], other=0.0).to(tl.float32)
            col = tl.minimum((kk + offs_g * SC) // scale_cols, scale_ncols - 1)
            acc_g += gt * (xt * tl.load(sg_row + col)[:, None])[None, :, :]
            acc_u += ut * (xt * tl.load(su_row + col)[:, None])[None, :, :]
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    return tl.sum(tl.sum(acc_g, axis=2), axis=1), tl.sum(tl.sum(acc_u, axis=2), axis=1)


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
    in ``_decode_gate_up_kernel``; BLOCK_N divides ``scale_rows`` and BLOCK_K ``scale_cols`` (or one scale column
    covers I), so a step's tile has one scale a slot, which multiplies the slot's activations."""
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
    if W_FP8:  # [K_PAD] scale rows of the slots' experts' rows; weights, so readable before the wait
        s_ptrs = s_ptr + e * s_e + ((pid_n * BLOCK_N) // scale_rows) * s_r
        s0 = tl.load(s_ptrs)
    if EARLY:
        pdl_wait(PDL)
    a_ptrs = h_ptr + slots[:, None] * I + offs_k[None, :]
    a0 = tl.load(a_ptrs, mask=local[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    if W_FP8:
        a0 = a0 * s0[:, None]
    acc = w0.to(tl.float32) * a0[:, None, :]
    for k0 in range(BLOCK_K, I, BLOCK_K):
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        k_mask = k0 + offs_k < I
        a_k = tl.load(a_ptrs, mask=local[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w_k = tl.load(w_ptrs, mask=local[:, None, None] & k_mask[None, None, :], other=0.0).to(tl.float32)
        if W_FP8:
            a_k = a_k * tl.load(s_ptrs + tl.minimum(k0 // scale_cols, scale_ncols - 1))[:, None]
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
    gate_up_k_sub: int | None = None, table_tokens: int | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.moe.fused_moe_ref``; meant for small ``T * k`` (decode). ``gate_up_config``
    ``(BLOCK_N over I, BLOCK_K over H, num_warps[, stages])`` and ``down_config`` ``(BLOCK_N over H, BLOCK_K over I,
    num_warps)`` override the table (``decode_config``; blocks and warps powers of two). ``w13`` / ``w2`` may be
    FP8 stacks (``Fp8Weight``): the table's tiles then become ``_fp8_gate_up``'s and ``_fp8_down``'s (as many bytes,
    twice the elements); an override is taken as it is, and must fit the scale blocks (``_check_fp8_tile``).
    ``gate_up_k_sub``: K tiles a gate/up loop step (1). ``table_tokens``: the table's configs for that many tokens
    whatever T is (``dispatch.rows_as_decode``: 1, so each token computes as in a one-token step)."""
    t, h, n_local, inter, top_k = check_kernel_inputs(x, w13, w2, topk_weights, topk_ids, num_local_experts)
    if t == 0 or h == 0 or top_k == 0:
        return torch.zeros(t, h, dtype=x.dtype, device=x.device)
    (w13, s13, b13), (w2, s2, b2) = expert_weights(w13), expert_weights(w2)
    default_gate_up, default_down = decode_config(table_tokens or t, top_k)
    k_pad = triton.next_power_of_2(top_k)
    if gate_up_config is None:
        gate_up, sc1 = _fp8_gate_up(_check_config(default_gate_up, stages=True), b13, h, inter)
    else:
        gate_up, sc1 = _check_config(gate_up_config, stages=True), 1
        if b13 is not None:
            sc1 = _check_fp8_tile("gate_up", gate_up[0], gate_up[1], b13, h, inter)
    bn1, bk1, warps1, stages1 = gate_up
    sub1 = gate_up_k_sub or 1
    if sub1 < 1:
        raise ValueError(f"gate_up_k_sub must be >= 1, got {sub1}")
    if down_config is None:
        bn2, bk2, warps2 = _fp8_down(_check_config(default_down), b2, inter, k_pad)
    else:
        bn2, bk2, warps2 = _check_config(down_config)
        if b2 is not None and _check_fp8_tile("down", bn2, bk2, b2, inter) < bk2:
            raise ValueError(f"down BLOCK_K {bk2} spans two {b2[1]}-wide scale columns")
    x = x if x.stride(1) == 1 else x.contiguous()
    n_slots = t * top_k
    ids = topk_ids.reshape(-1).contiguous()
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(n_slots, inter, dtype=torch.float32, device=x.device)
    pdl = pdl_launch(x)
    early = bool(pdl)  # the down kernel's early reads need the gate/up kernel's late trigger
    y = torch.empty(t, h, dtype=x.dtype, device=x.device)  # every element is written
    _decode_gate_up_kernel[(n_slots, triton.cdiv(inter, bn1))](
        x, w13, ids, act, top_k, h, inter, x.stride(0), expert_offset, n_local,
        BLOCK_N=bn1, BLOCK_K=bk1, STAGES=stages1, num_warps=warps1, LATE_TRIGGER=early, **pdl,
        **fp8_scale_args(s13, b13), **({"K_SUB": sub1} if sub1 > 1 else {}), **({"SC": sc1} if b13 else {}),
    )
    _decode_down_kernel[(t, triton.cdiv(h, bn2))](
        act, w2, ids, tw, y, top_k, h, inter, y.stride(0), expert_offset, n_local,
        K_PAD=triton.next_power_of_2(top_k), BLOCK_N=bn2, BLOCK_K=bk2, num_warps=warps2, EARLY=early, **pdl,
        **fp8_scale_args(s2, b2),
    )
    return y


def _check_fp8_tile(name: str, bn: int, bk: int, block: tuple[int, int], k: int, offset: int = 0) -> int:
    """An FP8 tile's SC (the chunk of its K tile inside one scale column), after checking that its BLOCK_N rows
    share a scale row (rows from ``offset`` on: the up rows start at I)."""
    if block[0] % bn or offset % bn:
        raise ValueError(f"{name} BLOCK_N {bn} must divide the {block[0]}-row scale blocks and {offset}")
    return min(bk, scale_tile_limit(block[1], k))


def _fp8_gate_up(config: tuple[int, ...], block: tuple[int, int] | None, h: int,
                 inter: int) -> tuple[tuple[int, ...], int]:
    """A gate/up config for FP8 weights and its SC: BLOCK_N divides the scale block's rows and I (so a program's
    rows share a scale row), SC the widest power of two within one scale column, BLOCK_K (a multiple of SC) as
    many elements as the 16-bit tile's, on half the warps: each thread loads the 16-bit kernel's bytes (at one
    token, 8 warps lost to 4 on the H200: bench/fp8_kernels.py's MoE variants)."""
    bn, bk, warps, *rest = config
    if block is None:
        return config, 1
    sc = scale_tile_limit(block[1], h)
    elements = bn * bk
    while bn > 1 and (block[0] % bn or inter % bn):
        bn //= 2
    bk = max(sc, min(elements // bn, triton.next_power_of_2(h)))
    return (bn, bk, max(1, warps // 2), *rest), min(sc, bk)


def _fp8_down(config: tuple[int, ...], block: tuple[int, int] | None, inter: int,
              k_pad: int) -> tuple[int, ...]:
    """A down config for FP8 weights: BLOCK_N divides the scale block's rows and BLOCK_K stays within one scale
    column (one scale a slot a step), the tile twice the 16-bit tile's elements where the registers allow
    (``DOWN_TILE_LIMIT``): its bytes."""
    bn, bk, warps = config
    if block is None:
        return config
    limit = min(scale_tile_limit(block[1], inter), triton.next_power_of_2(inter))
    elements = bn * bk * 2
    while bn > 1 and block[0] % bn:
        bn //= 2
    bk = min(limit, max(bk, elements // bn))
    while bn * 2 * bk <= elements and block[0] % (bn * 2) == 0:
        bn *= 2
    while k_pad * bn * bk > DOWN_TILE_LIMIT * 32 * warps and bk > 16:
        bk //= 2
    return bn, bk, warps
