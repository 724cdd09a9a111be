"""Skinny GEMM ``y = x @ W^T (+ bias)`` for batch-1..16 decode: Triton kernel and torch reference.

At M <= 16 a linear layer streams its weight: N*K*elt bytes read, almost no math, so the kernel is built for
bandwidth. Each program owns BLOCK_N rows of W (nn.Linear layout, K contiguous) and walks K in BLOCK_K-wide
coalesced tiles, reading every weight byte once; x (at most 16 rows, from L1/L2) is re-read per tile. M = 1
(and fp32 at any M) multiplies in fp32 on the CUDA cores into a [BLOCK_N, BLOCK_M, BLOCK_K] accumulator reduced
once after the loop; 16-bit M >= 2 uses ``tl.dot(W, x^T)`` (swap-AB: W is the A operand, x padded to 16 rows) so
the tensor cores do the math. When N / BLOCK_N programs cannot fill the GPU, K is split: the programs write fp32
partials to a workspace that a tiny second kernel sums in a fixed order (deterministic, no atomics). Launch
parameters come from a small deterministic heuristic, not triton.autotune, so calls are CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.triton_compat import INTERPRET, pdl_launch, pdl_wait, tl, triton
from kernels.triton_compat import jit as _jit
from kernels.triton_norm import rms_norm_ref

SKINNY_MAX_M = 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: ``F.linear`` in float32, cast to x's dtype."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


@_jit
def _load_weight_tile(w_base, k, K, offs_k, EVEN_K: tl.constexpr):
    if EVEN_K:
        w = tl.load(w_base + k)
    else:
        w = tl.load(w_base + k, mask=(k + offs_k < K)[None, :], other=0.0)
    return w


@_jit
def _accumulate_tile(w, k, K, offs_k, x_base, r_base, nw_ptr, acc, squares,
                     NORM: tl.constexpr, HAS_RES: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
                     EVEN_K: tl.constexpr):
    """acc += W tile (at column k) times x's tile; with NORM, x's tile is ``(x (+ r)) * nw`` and its squares are
    summed into ``squares``."""
    k_mask = (k + offs_k < K)[None, :]
    if EVEN_K:
        x_in = tl.load(x_base + k)
    else:
        x_in = tl.load(x_base + k, mask=k_mask, other=0.0)
    x = x_in
    if NORM:
        xs = x_in.to(tl.float32)
        if HAS_RES:  # the sum rounded to the activation dtype first, as the torch add does
            if EVEN_K:
                r = tl.load(r_base + k)
            else:
                r = tl.load(r_base + k, mask=k_mask, other=0.0)
            xs = (xs + r.to(tl.float32)).to(x_in.dtype).to(tl.float32)
        squares += xs * xs
        nw = tl.load(nw_ptr + k + offs_k, mask=k + offs_k < K, other=0.0).to(tl.float32)
        x = xs * nw[None, :]  # fp32 for the FMA path, rounded once for the tensor cores
        if USE_DOT and not DOT_FP32:
            x = x.to(w.dtype)
    if DOT_FP32:
        acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    elif USE_DOT:
        acc = tl.dot(w, tl.trans(x), acc)
    else:  # elementwise FMAs only; the cross-lane reduction over K happens once, after the loop
        acc += w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]
    return acc, squares


@_jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr,
    M, N, K, k_split, x_s0,
    r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, eps,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM: tl.constexpr = False, HAS_RES: tl.constexpr = False, WRITE_NORMED: tl.constexpr = False,
    WRITE_BLOCK: tl.constexpr = 16, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
    ROW_LOOP: tl.constexpr = False,
):
    """ROW_LOOP: each program runs the one-row program (M = 1, BLOCK_M = 1) for each of the M rows in turn, the
    same operations on the same tiles as a one-row launch, so every row's bits equal its own one-row launch's
    whatever M is (speculative verify rows against one-token decode rows). The weight slice a program streams is
    read again per row, from L1/L2."""
    if ROW_LOOP:
        for row in range(M):
            _gemv_program(x_ptr + row * x_s0, w_ptr, b_ptr, y_ptr + row * N, ws_ptr + row * N, M * N,
                          1, N, K, k_split, x_s0, r_ptr + row * r_s0, r_s0, nw_ptr, res_out_ptr + row * K,
                          normed_ptr + row * K, eps, HAS_BIAS, SPLIT, USE_DOT, DOT_FP32, EVEN_K, BLOCK_M, BLOCK_N,
                          BLOCK_K, NORM, HAS_RES, WRITE_NORMED, WRITE_BLOCK, PREFETCH, PDL)
    else:
        _gemv_program(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M * N, M, N, K, k_split, x_s0, r_ptr, r_s0, nw_ptr,
                      res_out_ptr, normed_ptr, eps, HAS_BIAS, SPLIT, USE_DOT, DOT_FP32, EVEN_K, BLOCK_M, BLOCK_N,
                      BLOCK_K, NORM, HAS_RES, WRITE_NORMED, WRITE_BLOCK, PREFETCH, PDL)


@_jit
def _gemv_program(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, ws_split_stride,
    M, N, K, k_split, x_s0,
    r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, eps,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, WRITE_NORMED: tl.constexpr,
    WRITE_BLOCK: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (N tiles, K splits): rows [pid_n*BLOCK_N, +BLOCK_N) of W over K range [pid_k*k_split, +k_split).

    NORM (no split): x is first ``rms_norm(x (+ r)) * nw``. The 1/rms factor is a per-row scalar, so the K loop
    multiplies by ``(x + r) * nw`` while it sums the squares and the accumulator is scaled once at the end: no
    pass over x before the weights stream. Each program then writes its slice of the new residual (HAS_RES) and
    of the normed rows (WRITE_NORMED).

    PREFETCH (with PDL): the first W tile (all of the program's rows when BLOCK_K covers K, as ``gemv_norm_config``
    picks for a router) is loaded before the wait for the kernel before: a weight is never written during a step."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # clamped rows: loads need no N/M mask (out-of-range rows re-read the last row and are never stored)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows_m = tl.minimum(offs_m, M - 1)
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    w_base = w_ptr + rows_n[:, None] * K + offs_k[None, :]
    x_base = x_ptr + rows_m[:, None] * x_s0 + offs_k[None, :]
    r_base = r_ptr + rows_m[:, None] * r_s0 + offs_k[None, :]
    squares = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)  # summed across lanes once, after the loop
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    k_start = k_lo
    if PREFETCH:
        w_first = _load_weight_tile(w_base, k_lo, K, offs_k, EVEN_K)
    pdl_wait(PDL)
    if PREFETCH:
        acc, squares = _accumulate_tile(w_first, k_lo, K, offs_k, x_base, r_base, nw_ptr, acc, squares,
                                        NORM, HAS_RES, USE_DOT, DOT_FP32, EVEN_K)
        k_start += BLOCK_K
    for k in range(k_start, k_hi, BLOCK_K):
        w = _load_weight_tile(w_base, k, K, offs_k, EVEN_K)
        acc, squares = _accumulate_tile(w, k, K, offs_k, x_base, r_base, nw_ptr, acc, squares,
                                        NORM, HAS_RES, USE_DOT, DOT_FP32, EVEN_K)
    if USE_DOT:
        out = acc
    else:
        out = tl.sum(acc, axis=2)
    out_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if SPLIT:
        tl.store(ws_ptr + pid_k * ws_split_stride + offs_m[None, :] * N + offs_n[:, None], out, mask=out_mask)
    else:
        if NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + eps)
            out = out * rstd[None, :]
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        y = out.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)  # x's precision, y's dtype (logits: fp32)
        tl.store(y_ptr + offs_m[None, :] * N + offs_n[:, None], y, mask=out_mask)
    if NORM and (HAS_RES or WRITE_NORMED):
        offs_c = tl.arange(0, WRITE_BLOCK)
        for c in range(pid_n * WRITE_BLOCK, K, tl.num_programs(0) * WRITE_BLOCK):
            c_mask = (offs_m < M)[:, None] & (c + offs_c < K)[None, :]
            at = offs_m[:, None] * K + (c + offs_c)[None, :]
            xc = tl.load(x_ptr + rows_m[:, None] * x_s0 + (c + offs_c)[None, :], mask=c_mask, other=0.0)
            if HAS_RES:
                rc = tl.load(r_ptr + rows_m[:, None] * r_s0 + (c + offs_c)[None, :], mask=c_mask, other=0.0)
                xc = (xc.to(tl.float32) + rc.to(tl.float32)).to(xc.dtype)
                tl.store(res_out_ptr + at, xc, mask=c_mask)
            if WRITE_NORMED:
                nwc = tl.load(nw_ptr + c + offs_c, mask=c + offs_c < K, other=0.0).to(tl.float32)
                tl.store(normed_ptr + at, (xc.to(tl.float32) * rstd[:, None] * nwc[None, :]).to(xc.dtype),
                         mask=c_mask)


@_jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, y_ptr, x_ptr, N, MN, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y[i] = sum over the SPLIT_K fp32 partials of element i (+ bias), split 0 first: a fixed order; rounded to
    x's dtype (``x_ptr`` is not read) and stored as y's."""
    pdl_wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Single-row 16-bit GEMVs on Hopper+ of a weight of at least GEMV_TMA_MIN_BYTES go to the persistent TMA kernel
# (kernels/triton_gemv_tma.py) when called without overrides: past that size its deep shared-memory pipeline keeps
# more weight bytes in flight than this kernel's occupancy does; below it, this kernel's many small programs are
# the faster (bench/results/gemv-tma-ab-*.json).
GEMV_TMA_MIN_BYTES = 32 << 20


def _tma_for(x: torch.Tensor, weight: torch.Tensor, row_loop: bool = False):
    """kernels.triton_gemv_tma when this GEMV goes there (W of at least ``GEMV_TMA_MIN_BYTES``, ``tma_supported``
    for one row, or for each row with ``row_loop``), else None. Imported at first use: it imports this module
    (``NormedProjection``)."""
    if weight.numel() * weight.element_size() < GEMV_TMA_MIN_BYTES:
        return None
    from kernels import triton_gemv_tma

    return triton_gemv_tma if triton_gemv_tma.tma_supported(x[:1] if row_loop else x, weight) else None


def gemv_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int = 132,
                use_dot: bool | None = None) -> dict[str, int | bool]:
    """Launch parameters from the shape alone (deterministic; ``bench/gemv_tune.py`` sweeps them). M = 1: CUDA-core
    FMAs on [2, 2 KiB] tiles (many small programs). M >= 2 (16-bit): tl.dot on [64, 512 B] W tiles, 4 pipeline
    stages. fp32 stays on FMAs (an exact fp32 tl.dot is several times slower). Under PDL the tiles are the same; the
    kernel loads its first W tile before it waits for the kernel before (``PREFETCH``)."""
    use_dot = dtype != torch.float32 and m > 1 if use_dot is None else use_dot
    if use_dot:
        block_m, block_n, block_k, stages = 16, 64, 512 // dtype.itemsize, 4  # 4 x 40 KiB of shared memory
    else:  # the [BLOCK_N, BLOCK_M, BLOCK_K] fp32 accumulator stays at <= 32 registers a thread (4 warps)
        block_m, stages = triton.next_power_of_2(m), 3
        block_k = min(2048 // dtype.itemsize, 1024 // block_m)
        block_n = 2 if block_m == 1 else 4
    lo = 16 if use_dot else 1
    block_k = min(block_k, max(lo, triton.next_power_of_2(k)))
    block_n = min(block_n, max(lo, triton.next_power_of_2(n)))
    # split K (powers of two) only while at most a quarter of the SMs have a program, keeping >= 4 K tiles a
    # program: the reduce kernel costs ~1 us, more than 64 deep-pipelined programs lose (N = 4096, dot path)
    tiles_n, tiles_k, split_k = triton.cdiv(n, block_n), triton.cdiv(k, block_k), 1
    while tiles_n * split_k <= num_sms // 4 and tiles_k >= 8 * split_k:
        split_k *= 2
    return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "split_k": split_k,
            "num_warps": 4, "num_stages": stages, "use_dot": use_dot}


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > SKINNY_MAX_M:
        raise ValueError(f"M = {x.shape[0]} exceeds SKINNY_MAX_M = {SKINNY_MAX_M}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype in {_DTYPES}, got {x.dtype} and {weight.dtype}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous ([N, K] row-major)")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({weight.shape[0]},)")


def gemv_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, use_dot: bool | None = None,
    prefetch: bool | None = None, row_loop: bool = False, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Same contract as ``gemv_ref`` for x [M<=16, K], W [N, K] contiguous; keywords override the heuristic.
    ``out_dtype`` (float32 for logits): y is stored in it, its values still rounded to x's dtype, so a wider y
    holds the same numbers and no cast kernel follows.
    On GPUs with dependent launch, W is read before the kernels before this one have finished: W must be a weight
    (nothing in the step writes it), as every caller's is. ``row_loop``: every row computed exactly as a one-row
    call computes it (``_gemv_kernel``'s ROW_LOOP; the TMA kernel's row loop for the weights it takes)."""
    _check_operands(x, weight, bias)
    (m, k), n = x.shape, weight.shape[0]
    if m == 0 or n == 0 or k == 0:
        return gemv_ref(x, weight, bias).to(out_dtype or x.dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    bias = None if bias is None else bias.contiguous()
    sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
    pdl = pdl_launch(x)
    overridden = (block_n, block_k, split_k, num_warps, num_stages, use_dot, prefetch) != (None,) * 7
    row_loop = row_loop and m > 1  # one row: the plain launch is the same program
    if not overridden and (tma := _tma_for(x, weight, row_loop)):
        return tma.gemv_tma(x, weight, bias, pdl=bool(pdl), row_loop=row_loop, out_dtype=out_dtype)
    cfg = gemv_config(1 if row_loop else m, n, k, x.dtype, sms, use_dot)
    bn, bk = block_n or cfg["block_n"], block_k or cfg["block_k"]
    if bn & (bn - 1) or bk & (bk - 1) or (cfg["use_dot"] and min(bn, bk) < 16):
        raise ValueError(f"block_n {bn} / block_k {bk} must be powers of two (>= 16 for the dot path)")
    k_split = triton.cdiv(triton.cdiv(k, bk), split_k or cfg["split_k"]) * bk  # a multiple of BLOCK_K
    splits = triton.cdiv(k, k_split)
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    ws = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    b = bias if bias is not None else y
    _gemv_kernel[(triton.cdiv(n, bn), splits)](
        x, weight, b, y, ws, m, n, k, k_split, x.stride(0),
        x, 0, x, y, y, 0.0,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, USE_DOT=cfg["use_dot"],
        DOT_FP32=cfg["use_dot"] and (INTERPRET or x.dtype == torch.float32), EVEN_K=k % bk == 0,
        BLOCK_M=cfg["block_m"], BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"], PREFETCH=bool(pdl) if prefetch is None else prefetch,
        ROW_LOOP=row_loop, **pdl,
    )
    if splits > 1:
        _splitk_reduce_kernel[(triton.cdiv(m * n, 1024),)](
            ws, b, y, x, n, m * n, SPLIT_K=splits, HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4, **pdl)
    return y


@dataclass(slots=True)
class NormedProjection:
    """What ``gemv_norm_triton`` returns: ``y`` the projection of the normed rows, ``residual`` the new residual
    (x + residual; x itself without one), ``normed`` the normed rows (when asked for)."""

    y: torch.Tensor
    residual: torch.Tensor
    normed: torch.Tensor | None = None


def gemv_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None,
                  write_normed: bool = False) -> NormedProjection:
    """The oracle: the residual-add RMSNorm (``rms_norm_ref``), then the projection."""
    if residual is None:
        normed, new_residual = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, new_residual = rms_norm_ref(x, norm_weight, eps, residual)
    return NormedProjection(gemv_ref(normed, weight, bias), new_residual, normed if write_normed else None)


def gemv_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None = None, write_normed: bool = False, *,
                     block_n: int | None = None, block_k: int | None = None,
                     num_warps: int | None = None, prefetch: bool | None = None,
                     row_loop: bool = False) -> NormedProjection:
    """``gemv_norm_ref`` in one launch: the residual-add RMSNorm in the GEMV's K loop (no K split). At decode
    batch sizes this replaces a norm kernel a layer. ``row_loop``: as ``gemv_triton``'s."""
    _check_operands(x, weight, bias)
    (m, k), n = x.shape, weight.shape[0]
    if norm_weight.shape != (k,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} / residual shape do not match x {tuple(x.shape)}")
    if m == 0 or n == 0 or k == 0:
        return gemv_norm_ref(x, residual, norm_weight, eps, weight, bias, write_normed)
    x = x if x.stride(1) == 1 else x.contiguous()
    r = x if residual is None else (residual if residual.stride(1) == 1 else residual.contiguous())
    sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
    pdl = pdl_launch(x)
    row_loop = row_loop and m > 1
    if (block_n, block_k, num_warps, prefetch) == (None,) * 4 and (tma := _tma_for(x, weight, row_loop)):
        return tma.gemv_norm_tma(x, residual, norm_weight, eps, weight, bias, write_normed, pdl=bool(pdl),
                                 row_loop=row_loop)
    cfg = gemv_norm_config(1 if row_loop else m, n, k, x.dtype, sms, pdl=bool(pdl))
    bn, bk = block_n or cfg["block_n"], block_k or cfg["block_k"]
    grid_n = triton.cdiv(n, bn)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = NormedProjection(y, x if residual is None else torch.empty_like(x),
                           torch.empty_like(x) if write_normed else None)
    write_block = max(16, min(2048 // cfg["block_m"], triton.next_power_of_2(triton.cdiv(k, grid_n))))
    _gemv_kernel[(grid_n, 1)](
        x, weight, bias if bias is not None else y, y, y, m, n, k, k, x.stride(0),
        r, r.stride(0), norm_weight, out.residual, out.normed if write_normed else y, eps,
        HAS_BIAS=bias is not None, SPLIT=False, USE_DOT=cfg["use_dot"],
        DOT_FP32=cfg["use_dot"] and (INTERPRET or x.dtype == torch.float32), EVEN_K=k % bk == 0,
        BLOCK_M=cfg["block_m"], BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps or cfg["num_warps"],
        num_stages=cfg["num_stages"], NORM=True, HAS_RES=residual is not None, WRITE_NORMED=write_normed,
        WRITE_BLOCK=write_block, PREFETCH=bool(pdl) if prefetch is None else prefetch, ROW_LOOP=row_loop, **pdl,
    )
    return out


def gemv_norm_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int = 132,
                     pdl: bool = False) -> dict[str, int | bool]:
    """``gemv_config`` without the K split (the norm needs a row's every square in one program). At M = 1 a
    projection of >= 1,024 rows takes [8, 1 KiB] tiles: with the norm's loads in the K loop, 8 weight rows a
    program stream better than the plain GEMV's 2 (``bench/gemv_norm_tune.py``). Under PDL a projection whose
    programs would not outnumber the SMs (a router's 128-264 rows) takes whole rows, about one program an SM: each
    program loads all of its weight before the wait and runs no K loop after it."""
    cfg = {**gemv_config(m, n, k, dtype, num_sms), "split_k": 1}
    if m == 1 and n >= 1024 and not cfg["use_dot"]:
        cfg["block_n"], cfg["block_k"] = 8, min(512, max(1, triton.next_power_of_2(k)))
    if pdl and m == 1 and not cfg["use_dot"] and triton.cdiv(n, cfg["block_n"]) <= num_sms:
        # too few rows to fill the GPU (a router): about one program an SM over whole rows, so every weight byte a
        # program reads is in flight before its wait (the [BLOCK_N, K] fp32 product within 32 registers a thread)
        block_n, block_k = triton.next_power_of_2(triton.cdiv(n, num_sms)), triton.next_power_of_2(k)
        if block_n * block_k <= 32 * 32 * cfg["num_warps"]:
            cfg["block_n"], cfg["block_k"] = block_n, block_k
    return cfg
