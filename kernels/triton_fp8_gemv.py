"""Skinny GEMM ``y = x @ dequantize(W)^T (+ bias)`` for batch-1..16 decode with FP8 weights: Triton kernel.

The weight stays as stored: float8_e4m3fn [NQ, K] with a float32 scale per ``block`` of it (128 x 128, a row for a
channel scale, the whole for a tensor scale; kernels/fp8.py), so decode streams one byte a weight where a 16-bit
weight reads two. The kernel is ``kernels/triton_gemv.py``'s with the dequantization in registers: each W tile is
converted exactly (e4m3 values are bf16, fp16 and fp32 values), multiplied with x's tile as there (FMAs at M = 1 and
in fp32, ``tl.dot`` at 16-bit M >= 2), and the product is scaled by its rows' scales for that K tile. BLOCK_K divides
the scale block's width (``scale_tile_limit``), so a K tile never spans two scale columns: one scale a row a tile;
a loop step takes K_SUB such tiles, so narrow scale blocks do not shrink the bytes a program has in flight.
Split-K, the fused residual-add RMSNorm, the row loop (each row with the bits of a one-row call) and float32 logits
are as in ``triton_gemv.py``, whose tile helpers and reduce kernel this reuses.

A weight may end in rows kept in 16 bits (``tail``: the Gated DeltaNet in_proj's b and a rows, which checkpoints keep
unquantized): programs past the fp8 rows' tiles read those rows instead and write y's last columns, so the whole
projection stays one launch. Launch parameters come from a deterministic heuristic: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import dequantize_fp8_ref, scale_tile_limit
from kernels.triton_compat import INTERPRET, pdl_launch, pdl_wait, tl, triton
from kernels.triton_compat import jit as _jit
from kernels.triton_fp8_grouped import fp8_epilogue, fp8_grouped_program
from kernels.triton_gemv import (SKINNY_MAX_M, NormedProjection, _accumulate_tile, _load_weight_tile, _num_sms,
                                 _splitk_reduce_kernel)
from kernels.triton_norm import rms_norm_ref

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None, tail: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: ``[x @ dequantize(W)^T, x @ tail^T] (+ bias)`` in float32, rounded once to x's dtype."""
    w = dequantize_fp8_ref(weight, scale, block)
    if tail is not None:
        w = torch.cat([w, tail.float()])
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def fp8_gemv_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      bias: torch.Tensor | None = None, write_normed: bool = False,
                      tail: torch.Tensor | None = None) -> NormedProjection:
    """The oracle of the norm-fused kernel: the residual-add RMSNorm (``rms_norm_ref``), then ``fp8_gemv_ref``."""
    if residual is None:
        normed, new_residual = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, new_residual = rms_norm_ref(x, norm_weight, eps, residual)
    y = fp8_gemv_ref(normed, weight, scale, block, bias, tail)
    return NormedProjection(y, new_residual, normed if write_normed else None)


# Where a kernel applies the fp8 rows' scales (``scale_mode``); constexprs, so the kernels can compare with them.
TILE_SCALES, ROW_SCALES, GROUPED = (tl.constexpr(v) if tl is not None else v for v in range(3))


@_jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, t_ptr, b_ptr, y_ptr, ws_ptr,
    M, NQ, NT, K, k_split, x_s0, s_s0, scale_rows, scale_cols, scale_ncols,
    r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, eps,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_SUB: tl.constexpr = 1, HAS_TAIL: tl.constexpr = False, NORM: tl.constexpr = False,
    HAS_RES: tl.constexpr = False, WRITE: tl.constexpr = False, WRITE_NORMED: tl.constexpr = False,
    WRITE_BLOCK: tl.constexpr = 16, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
    ROW_LOOP: tl.constexpr = False, SCALE_MODE: tl.constexpr = 0, SC: tl.constexpr = 128,
):
    """ROW_LOOP: each program runs the one-row program for each of the M rows in turn (``triton_gemv``'s ROW_LOOP),
    so every row's bits equal its own one-row launch's whatever M is. WRITE (with NORM): write the new residual
    (HAS_RES) and the normed rows (WRITE_NORMED). SCALE_MODE: ``scale_mode``'s; SC: the scale block's width."""
    N = NQ + NT
    if ROW_LOOP:
        for row in range(M):
            _fp8_gemv_rows(x_ptr + row * x_s0, w_ptr, s_ptr, t_ptr, b_ptr, y_ptr + row * N, ws_ptr + row * N, M * N,
                           1, NQ, NT, K, k_split, x_s0, s_s0, scale_rows, scale_cols, scale_ncols,
                           r_ptr + row * r_s0, r_s0, nw_ptr, res_out_ptr + row * K, normed_ptr + row * K, eps,
                           HAS_BIAS, SPLIT, USE_DOT, DOT_FP32, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, K_SUB, HAS_TAIL,
                           NORM, HAS_RES, WRITE, WRITE_NORMED, WRITE_BLOCK, PREFETCH, PDL, SCALE_MODE, SC)
    else:
        _fp8_gemv_rows(x_ptr, w_ptr, s_ptr, t_ptr, b_ptr, y_ptr, ws_ptr, M * N, M, NQ, NT, K, k_split, x_s0, s_s0,
                       scale_rows, scale_cols, scale_ncols, r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, eps,
                       HAS_BIAS, SPLIT, USE_DOT, DOT_FP32, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, K_SUB, HAS_TAIL, NORM,
                       HAS_RES, WRITE, WRITE_NORMED, WRITE_BLOCK, PREFETCH, PDL, SCALE_MODE, SC)


@_jit
def _fp8_gemv_rows(
    x_ptr, w_ptr, s_ptr, t_ptr, b_ptr, y_ptr, ws_ptr, ws_split_stride,
    M, NQ, NT, K, k_split, x_s0, s_s0, scale_rows, scale_cols, scale_ncols,
    r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, eps,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_SUB: tl.constexpr, HAS_TAIL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, WRITE: tl.constexpr,
    WRITE_NORMED: tl.constexpr, WRITE_BLOCK: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
    SCALE_MODE: tl.constexpr, SC: tl.constexpr,
):
    """Program ``pid_n`` takes fp8 row tile ``pid_n``, or with a tail, past the fp8 tiles, tail row tile
    ``pid_n - tiles_q`` (y columns NQ on). Only the fp8 programs write the residual and normed rows."""
    pid_n = tl.program_id(0)
    tiles_q = tl.cdiv(NQ, BLOCK_N)
    if HAS_TAIL and pid_n >= tiles_q:
        _fp8_gemv_program(x_ptr, t_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, ws_split_stride, pid_n - tiles_q, NT, NQ,
                          NQ + NT, M, K, k_split, x_s0, s_s0, scale_rows, scale_cols, scale_ncols, r_ptr, r_s0,
                          nw_ptr, res_out_ptr, normed_ptr, eps, 0, 1, HAS_BIAS, SPLIT, USE_DOT, DOT_FP32,
                          EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, K_SUB, False, NORM, HAS_RES, False, WRITE_NORMED,
                          WRITE_BLOCK, PREFETCH, PDL, TILE_SCALES)
    elif SCALE_MODE == GROUPED:
        fp8_grouped_program(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, ws_split_stride, pid_n, NQ, NQ + NT, K,
                             k_split, x_s0, s_s0, scale_rows, scale_ncols, r_ptr, r_s0, nw_ptr, res_out_ptr,
                             normed_ptr, eps, tiles_q, HAS_BIAS, SPLIT, EVEN_K, BLOCK_N, BLOCK_K, SC, K_SUB, NORM,
                             HAS_RES, WRITE, WRITE_NORMED, WRITE_BLOCK, PREFETCH, PDL)
    else:
        _fp8_gemv_program(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, ws_split_stride, pid_n, NQ, 0, NQ + NT, M, K,
                          k_split, x_s0, s_s0, scale_rows, scale_cols, scale_ncols, r_ptr, r_s0, nw_ptr, res_out_ptr,
                          normed_ptr, eps, pid_n, tiles_q, HAS_BIAS, SPLIT, USE_DOT, DOT_FP32, EVEN_K, BLOCK_M,
                          BLOCK_N, BLOCK_K, K_SUB, True, NORM, HAS_RES, WRITE, WRITE_NORMED, WRITE_BLOCK, PREFETCH,
                          PDL, SCALE_MODE)


@_jit
def _fp8_sub_tile(w, k, K, offs_k, x_base, r_base, nw_ptr, s_base, scale_cols, scale_ncols, acc, squares,
                  IS_FP8: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, USE_DOT: tl.constexpr,
                  DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                  SCALE_MODE: tl.constexpr):
    """acc += the loaded W tile at column k times x's tile. TILE_SCALES: the product scaled by its rows' scales for
    this K tile (the dot path scales the tile's fp32 product, the FMA path the converted tile before its products;
    the scale column is clamped: a tile past K, masked to zeros, reads the last one). ROW_SCALES and 16-bit W:
    unscaled (the rows' scales apply after the loop)."""
    if not IS_FP8:
        acc, squares = _accumulate_tile(w, k, K, offs_k, x_base, r_base, nw_ptr, acc, squares,
                                        NORM, HAS_RES, USE_DOT, DOT_FP32, EVEN_K)
    elif SCALE_MODE == ROW_SCALES:
        wq = w.to(x_base.dtype.element_ty) if USE_DOT and not DOT_FP32 else w.to(tl.float32)
        acc, squares = _accumulate_tile(wq, k, K, offs_k, x_base, r_base, nw_ptr, acc, squares,
                                        NORM, HAS_RES, USE_DOT, DOT_FP32, EVEN_K)
    else:
        s = tl.load(s_base + tl.minimum(k // scale_cols, scale_ncols - 1))
        if USE_DOT:
            wq = w.to(tl.float32) if DOT_FP32 else w.to(x_base.dtype.element_ty)
            part, squares = _accumulate_tile(wq, k, K, offs_k, x_base, r_base, nw_ptr,
                                             tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), squares,
                                             NORM, HAS_RES, USE_DOT, DOT_FP32, EVEN_K)
            acc += part * s[:, None]
        else:
            acc, squares = _accumulate_tile(w.to(tl.float32) * s[:, None], k, K, offs_k, x_base, r_base, nw_ptr,
                                            acc, squares, NORM, HAS_RES, False, False, EVEN_K)
    return acc, squares


@_jit
def _fp8_gemv_program(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, ws_split_stride, tile, n_rows, col0, N,
    M, K, k_split, x_s0, s_s0, scale_rows, scale_cols, scale_ncols,
    r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, eps, write_pid, write_programs,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SUB: tl.constexpr,
    IS_FP8: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, WRITE: tl.constexpr,
    WRITE_NORMED: tl.constexpr, WRITE_BLOCK: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
    SCALE_MODE: tl.constexpr,
):
    """Rows [tile*BLOCK_N, +BLOCK_N) of ``w_ptr``'s ``n_rows`` over K range [pid_k*k_split, +k_split), into y
    columns ``col0 +`` those rows (row stride N). A loop step takes K_SUB tiles of BLOCK_K (TILE_SCALES: one scale
    column each), so a program has K_SUB * BLOCK_K weight bytes a row in flight though the scale blocks are narrow;
    k_split is a multiple of K_SUB * BLOCK_K, so a step never crosses into another split's range. As
    ``_gemv_program`` otherwise: NORM scales the product by each row's 1/rms once after the loop; PREFETCH loads the
    first tile (a weight: nothing in a step writes it) before the wait; WRITE: the residual and normed rows, their
    columns split over ``write_programs``."""
    pid_k = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows_n = tl.minimum(offs_n, n_rows - 1).to(tl.int64)  # clamped: out-of-range rows are never stored
    rows_m = tl.minimum(offs_m, M - 1)
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    w_base = w_ptr + rows_n[:, None] * K + offs_k[None, :]
    s_base = s_ptr + (rows_n // scale_rows) * s_s0
    x_base = x_ptr + rows_m[:, None] * x_s0 + offs_k[None, :]
    r_base = r_ptr + rows_m[:, None] * r_s0 + offs_k[None, :]
    squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    k_start = k_lo
    if PREFETCH:
        w_first = _load_weight_tile(w_base, k_lo, K, offs_k, EVEN_K)
    pdl_wait(PDL)
    if PREFETCH:  # the first step: its first tile loaded early, the rest of it now
        acc, squares = _fp8_sub_tile(w_first, k_lo, K, offs_k, x_base, r_base, nw_ptr, s_base, scale_cols,
                                     scale_ncols, acc, squares, IS_FP8, NORM, HAS_RES, USE_DOT, DOT_FP32, EVEN_K,
                                     BLOCK_N, BLOCK_M, SCALE_MODE)
        for j in tl.static_range(1, K_SUB):
            kk = k_lo + j * BLOCK_K
            w = _load_weight_tile(w_base, kk, K, offs_k, EVEN_K)
            acc, squares = _fp8_sub_tile(w, kk, K, offs_k, x_base, r_base, nw_ptr, s_base, scale_cols,
                                         scale_ncols, acc, squares, IS_FP8, NORM, HAS_RES, USE_DOT, DOT_FP32, EVEN_K,
                                         BLOCK_N, BLOCK_M, SCALE_MODE)
        k_start += BLOCK_K * K_SUB
    for k in range(k_start, k_hi, BLOCK_K * K_SUB):
        for j in tl.static_range(K_SUB):
            kk = k + j * BLOCK_K
            w = _load_weight_tile(w_base, kk, K, offs_k, EVEN_K)
            acc, squares = _fp8_sub_tile(w, kk, K, offs_k, x_base, r_base, nw_ptr, s_base, scale_cols,
                                         scale_ncols, acc, squares, IS_FP8, NORM, HAS_RES, USE_DOT, DOT_FP32, EVEN_K,
                                         BLOCK_N, BLOCK_M, SCALE_MODE)
    if USE_DOT:
        out = acc
    else:
        out = tl.sum(acc, axis=2)
    if IS_FP8 and SCALE_MODE == ROW_SCALES:
        out = out * tl.load(s_base)[:, None]
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + eps)
    else:
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    fp8_epilogue(out, rstd, offs_n, offs_m, rows_m, n_rows, col0, N, M, K, pid_k, x_ptr, x_s0, b_ptr, y_ptr,
                  ws_ptr, ws_split_stride, r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, write_pid, write_programs,
                  HAS_BIAS, SPLIT, NORM, HAS_RES, WRITE, WRITE_NORMED, WRITE_BLOCK)


FMA_STEP = 512  # TILE_SCALES at M = 1 (and fp32): weight bytes a row a program takes a loop step
DOT_STEP = 256  # 16-bit M >= 2
# M = 1 GROUPED tiles (BLOCK_N, BLOCK_K, K_SUB, num_warps), 4 KiB of fp8 a step: two rows a program while that
# leaves the GPU few programs, four rows past MANY_ROWS (bench/fp8_kernels.py's variants).
GROUPED_TILE, GROUPED_WIDE_TILE, MANY_ROWS = (2, 1024, 2, 4), (4, 1024, 1, 4), 16384
GROUPED_NORM_TILE = (8, 512, 1, 4)  # the norm-fused M = 1 GEMV of >= 1,024 rows


def scale_mode(m: int, block: tuple[int, int], k: int, use_dot: bool, block_n: int, block_k: int) -> int:
    """Where the fp8 rows' scales apply. ROW_SCALES: one scale column covers K, so each row's scale multiplies its
    sum once after the loop (any tile width). GROUPED (one row of x on the FMAs): the tile's rows share a scale row
    and its width is a multiple of the scale block's, so the scales multiply x's columns (``fp8_grouped_program``).
    TILE_SCALES otherwise: a K tile within one scale column, its rows' scales multiply the tile or its product."""
    rows, cols = block
    if cols >= k:
        return ROW_SCALES
    if m == 1 and not use_dot and cols & (cols - 1) == 0 and block_k % cols == 0 and rows % block_n == 0:
        return GROUPED
    return TILE_SCALES


def fp8_gemv_config(m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype, num_sms: int = 132,
                    use_dot: bool | None = None, norm: bool = False) -> dict[str, int | bool]:
    """Launch parameters from the shape alone (deterministic), as ``gemv_config``'s. M = 1: GROUPED tiles
    (``GROUPED_TILE``) of the 16-bit kernel's bytes, spanning several scale columns; where the scale blocks do not
    allow them, BLOCK_K at most ``scale_tile_limit`` and K_SUB such tiles a step ([8, 128] four a step on the FMAs).
    16-bit M >= 2: ``tl.dot`` on [64, 128] tiles two a step (any tile width with ROW_SCALES). ``norm`` (no K split):
    at M = 1 with >= 1,024 rows 8 rows a program, as ``gemv_norm_config``."""
    rows, cols = block
    k_limit = 1 << max(0, (k - 1).bit_length()) if cols >= k else scale_tile_limit(cols, k)
    use_dot = dtype != torch.float32 and m > 1 if use_dot is None else use_dot
    use_dot = use_dot and k_limit >= 16
    warps = 4
    grouped = GROUPED_NORM_TILE if norm and n >= 1024 else GROUPED_WIDE_TILE if n >= MANY_ROWS else GROUPED_TILE
    if use_dot:
        block_m, block_n, block_k, stages = 16, 64, min(k_limit, DOT_STEP), 4
        k_sub = max(1, DOT_STEP // block_k)
    elif m == 1 and cols < k and cols & (cols - 1) == 0 and (rows % grouped[0] == 0 or rows == 1):
        block_m, stages = 1, 3
        block_n, block_k, k_sub, warps = grouped
        if rows % block_n:  # one-row scale blocks: one row a program, its tile as many bytes
            block_n, block_k = 1, block_k * block_n
        block_k = max(cols, min(block_k, triton.next_power_of_2(k)))
    else:  # the [BLOCK_N, BLOCK_M, BLOCK_K] fp32 accumulator stays at <= 32 registers a thread (4 warps)
        block_m, stages = triton.next_power_of_2(m), 3
        block_k = min(k_limit, 1024 // block_m)
        block_n = max(2, 1024 // (block_m * block_k))
        if norm and m == 1 and n >= 1024:
            block_n, block_k = 8, min(k_limit, 512)
        k_sub = max(1, FMA_STEP // block_k)
    lo = 16 if use_dot else 1
    block_k = min(block_k, max(lo, triton.next_power_of_2(k))) if cols >= k or block_k <= cols else block_k
    block_n = min(block_n, max(lo, triton.next_power_of_2(n)))
    k_sub = max(1, min(k_sub, triton.next_power_of_2(triton.cdiv(k, block_k))))
    tiles_n, steps, split_k = triton.cdiv(n, block_n), triton.cdiv(k, block_k * k_sub), 1
    if use_dot:  # [64, 128] fp8 tiles: split until about two programs an SM, keeping >= 4 steps a split
        while not norm and tiles_n * split_k * 2 <= 2 * num_sms and steps >= 8 * split_k:
            split_k *= 2
    while not norm and tiles_n * split_k <= num_sms // 4 and steps >= 8 * split_k:
        split_k *= 2
    return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "k_sub": k_sub, "split_k": split_k,
            "num_warps": warps, "num_stages": stages, "use_dot": use_dot}


def _check_operands(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                    bias: torch.Tensor | None, tail: torch.Tensor | None) -> int:
    """The kernels' contract; returns the projection's rows (fp8 rows + tail rows)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > SKINNY_MAX_M:
        raise ValueError(f"M = {x.shape[0]} exceeds SKINNY_MAX_M = {SKINNY_MAX_M}")
    if x.dtype not in _X_DTYPES or weight.dtype != torch.float8_e4m3fn or not weight.is_contiguous():
        raise ValueError(f"need x in {_X_DTYPES} and a contiguous float8_e4m3fn weight, got {x.dtype}, {weight.dtype}")
    grid = (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
    if scale.dtype != torch.float32 or tuple(scale.shape) != grid or scale.stride(1) != 1:
        raise ValueError(f"scale must be float32 {list(grid)} (row-major), got {scale.dtype} {list(scale.shape)}")
    n = weight.shape[0]
    if tail is not None:
        if tail.dtype != x.dtype or tail.dim() != 2 or tail.shape[1] != x.shape[1] or not tail.is_contiguous():
            raise ValueError(f"tail must be a contiguous [NT, K] {x.dtype} weight, got {tail.dtype} "
                             f"{tuple(tail.shape)}")
        n += tail.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({n},)")
    return n


def fp8_gemv_triton(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
    bias: torch.Tensor | None = None, *, tail: torch.Tensor | None = None,
    block_n: int | None = None, block_k: int | None = None, k_sub: int | None = None, split_k: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, use_dot: bool | None = None,
    prefetch: bool | None = None, row_loop: bool = False, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Same contract as ``fp8_gemv_ref`` for x [M<=16, K], W float8 [NQ, K] contiguous with its scale grid (and a
    16-bit ``tail`` [NT, K] after it); keywords override the heuristic. ``out_dtype`` and ``row_loop``: as
    ``gemv_triton``'s (float32 logits holding x-precision values; every row as a one-row call computes it)."""
    n = _check_operands(x, weight, scale, block, bias, tail)
    (m, k), nq = x.shape, weight.shape[0]
    if m == 0 or n == 0 or k == 0:
        return fp8_gemv_ref(x, weight, scale, block, bias, tail).to(out_dtype or x.dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
    pdl = pdl_launch(x)
    row_loop = row_loop and m > 1  # one row: the plain launch is the same program
    cfg = fp8_gemv_config(1 if row_loop else m, n, k, block, x.dtype, sms, use_dot)
    bn, bk, sub = block_n or cfg["block_n"], block_k or cfg["block_k"], k_sub or cfg["k_sub"]
    mode = _checked_mode(1 if row_loop else m, bn, bk, sub, cfg["use_dot"], block, k)
    step = bk * sub
    k_split = triton.cdiv(triton.cdiv(k, step), split_k or cfg["split_k"]) * step  # whole loop steps
    splits = triton.cdiv(k, k_split)
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    ws = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    b = bias if bias is not None else y
    nt = 0 if tail is None else tail.shape[0]
    grid_n = triton.cdiv(nq, bn) + triton.cdiv(nt, bn)
    _fp8_gemv_kernel[(grid_n, splits)](
        x, weight, scale, weight if tail is None else tail, b, y, ws, m, nq, nt, k, k_split, x.stride(0),
        scale.stride(0), block[0], block[1], scale.shape[1], x, 0, x, y, y, 0.0,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, USE_DOT=cfg["use_dot"],
        DOT_FP32=cfg["use_dot"] and (INTERPRET or x.dtype == torch.float32), EVEN_K=k % step == 0,
        BLOCK_M=cfg["block_m"], BLOCK_N=bn, BLOCK_K=bk, K_SUB=sub, HAS_TAIL=nt > 0,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
        PREFETCH=bool(pdl) if prefetch is None else prefetch, ROW_LOOP=row_loop, SCALE_MODE=mode, SC=block[1],
        **pdl,
    )
    if splits > 1:
        _splitk_reduce_kernel[(triton.cdiv(m * n, 1024),)](
            ws, b, y, x, n, m * n, SPLIT_K=splits, HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4, **pdl)
    return y


def fp8_gemv_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None = None,
    write_normed: bool = False, *, tail: torch.Tensor | None = None, block_n: int | None = None,
    block_k: int | None = None, k_sub: int | None = None, num_warps: int | None = None,
    prefetch: bool | None = None, row_loop: bool = False,
) -> NormedProjection:
    """``fp8_gemv_norm_ref`` in one launch: the residual-add RMSNorm in the GEMV's K loop (no K split), as
    ``gemv_norm_triton`` does for 16-bit weights. ``row_loop``: as ``gemv_triton``'s."""
    n = _check_operands(x, weight, scale, block, bias, tail)
    (m, k), nq = x.shape, weight.shape[0]
    if norm_weight.shape != (k,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} / residual shape do not match x {tuple(x.shape)}")
    if m == 0 or n == 0 or k == 0:
        return fp8_gemv_norm_ref(x, residual, norm_weight, eps, weight, scale, block, bias, write_normed, tail)
    x = x if x.stride(1) == 1 else x.contiguous()
    r = x if residual is None else (residual if residual.stride(1) == 1 else residual.contiguous())
    pdl = pdl_launch(x)
    row_loop = row_loop and m > 1
    cfg = fp8_gemv_config(1 if row_loop else m, n, k, block, x.dtype, norm=True)
    bn, bk, sub = block_n or cfg["block_n"], block_k or cfg["block_k"], k_sub or cfg["k_sub"]
    mode = _checked_mode(1 if row_loop else m, bn, bk, sub, cfg["use_dot"], block, k)
    nt = 0 if tail is None else tail.shape[0]
    tiles_q = triton.cdiv(nq, bn)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = NormedProjection(y, x if residual is None else torch.empty_like(x),
                           torch.empty_like(x) if write_normed else None)
    write_block = max(16, min(2048 // cfg["block_m"], triton.next_power_of_2(triton.cdiv(k, tiles_q))))
    _fp8_gemv_kernel[(tiles_q + triton.cdiv(nt, bn), 1)](
        x, weight, scale, weight if tail is None else tail, bias if bias is not None else y, y, y, m, nq, nt, k, k,
        x.stride(0), scale.stride(0), block[0], block[1], scale.shape[1], r, r.stride(0), norm_weight, out.residual,
        out.normed if write_normed else y, eps,
        HAS_BIAS=bias is not None, SPLIT=False, USE_DOT=cfg["use_dot"],
        DOT_FP32=cfg["use_dot"] and (INTERPRET or x.dtype == torch.float32), EVEN_K=k % (bk * sub) == 0,
        BLOCK_M=cfg["block_m"], BLOCK_N=bn, BLOCK_K=bk, K_SUB=sub, HAS_TAIL=nt > 0, NORM=True,
        HAS_RES=residual is not None, WRITE=residual is not None or write_normed, WRITE_NORMED=write_normed,
        WRITE_BLOCK=write_block, PREFETCH=bool(pdl) if prefetch is None else prefetch, ROW_LOOP=row_loop,
        SCALE_MODE=mode, SC=block[1], num_warps=num_warps or cfg["num_warps"], num_stages=cfg["num_stages"], **pdl,
    )
    return out


def _checked_mode(m: int, bn: int, bk: int, k_sub: int, use_dot: bool, block: tuple[int, int], k: int) -> int:
    """The launch's ``scale_mode``, after checking its tiles."""
    if bn & (bn - 1) or bk & (bk - 1) or (use_dot and min(bn, bk) < 16) or k_sub < 1:
        raise ValueError(f"block_n {bn} / block_k {bk} must be powers of two (>= 16 for the dot path), k_sub "
                         f"{k_sub} >= 1")
    mode = scale_mode(m, block, k, use_dot, bn, bk)
    if mode == TILE_SCALES and bk > scale_tile_limit(block[1], k):
        raise ValueError(f"block_k {bk} spans two {block[1]}-wide scale columns")
    return mode
