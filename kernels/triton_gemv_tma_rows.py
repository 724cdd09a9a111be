"""Row-invariant persistent GEMV ``y[M, N] = x[M, K] @ W[N, K]^T`` for 1..16 rows: TMA weight tiles, CUDA cores,
each tile reduced over K at once.

Why it exists: a speculative verify row must give each token the bits a one-token decode row gives it. The TMA
kernel (kernels/triton_gemv_tma.py) keeps a [BLOCK_N, BLOCK_K] fp32 accumulator per row across the K loop and
reduces it once; several rows sharing a weight tile would need one such accumulator each, so its verify rows loop
over the one-row program instead and stream the weights once per row. Here every tile is reduced right away: each
row adds ``sum(W tile * x tile)`` ([BLOCK_N] values) to its own outputs, so a tile loaded once serves every row with
the registers of one, and one binary (M not specialised) runs every row count: a row's bits never depend on how many
rows there are. The cost is a cross-lane reduction a tile a row.

The schedule and tiles are the TMA kernel's (``tma_config``). NORM: the residual-add RMSNorm as there, a row's
squares summed a tile at a time.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import pdl_launch, tl, triton
from kernels.triton_compat import jit as _jit
from kernels.triton_gemv import NormedProjection
from kernels.triton_gemv_tma import TensorDescriptor, _first_tile_then_wait, _sms, tma_config, tma_supported

MAX_ROWS = 16


@_jit
def _tile_rows(w, k, K, offs_k, cols_m, M, x_ptr, r_ptr, nw_ptr, outs, sq,
               NORM: tl.constexpr, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr):
    """For each row m < M: outs[:, m] += sum over the tile of W * x[m] (x[m] normed by nw with NORM, its squares
    into sq[m])."""
    wf = w.to(tl.float32)
    k_mask = k + offs_k < K
    if NORM:
        nw = tl.load(nw_ptr + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    for m in range(M):
        if EVEN_K:
            x_in = tl.load(x_ptr + m * K + k + offs_k)
        else:
            x_in = tl.load(x_ptr + m * K + k + offs_k, mask=k_mask, other=0.0)
        xs = x_in.to(tl.float32)
        if NORM:
            if HAS_RES:  # the sum rounded to the activation dtype first, as the torch add does
                r = tl.load(r_ptr + m * K + k + offs_k, mask=k_mask, other=0.0)
                xs = (xs + r.to(tl.float32)).to(x_in.dtype).to(tl.float32)
            sq = tl.where(cols_m == m, sq + tl.sum(xs * xs, axis=0), sq)
            xs = xs * nw
        part = tl.sum(wf * xs[None, :], axis=1)
        outs = tl.where(cols_m[None, :] == m, outs + part[:, None], outs)
    return outs, sq


@_jit
def _finish_rows(outs, sq, rb, M, N, K, eps, b_ptr, y_ptr, BLOCK_N: tl.constexpr, MPAD: tl.constexpr,
                 NORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Row block ``rb``'s outputs of every row: times the row's 1/rms (NORM), plus the bias, stored; returns 1/rms."""
    offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_m = tl.arange(0, MPAD)
    out = outs
    rstd = sq  # unused without NORM
    if NORM:
        rstd = 1.0 / tl.sqrt(sq / K + eps)
        out = out * rstd[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    mask = (offs_n < N)[:, None] & (cols_m < M)[None, :]
    tl.store(y_ptr + cols_m[None, :] * N + offs_n[:, None], out.to(y_ptr.dtype.element_ty), mask=mask)
    return rstd


@_jit(do_not_specialize=["M"])
def _gemv_tma_rows_shared_kernel(
    w_desc, w_ptr, x_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, res_out_ptr, normed_ptr, M, N, K, eps,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, WRITE_NORMED: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    WRITE_BLOCK: tl.constexpr, MPAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program pid: row blocks pid, pid + grid, ... of W, their K tiles in one pipelined loop (as the TMA kernel);
    every tile serves all M rows."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, grid) * k_tiles  # the launch keeps grid <= row blocks
    offs_k = tl.arange(0, BLOCK_K)
    cols_m = tl.arange(0, MPAD)
    outs = tl.zeros((BLOCK_N, MPAD), dtype=tl.float32)
    sq = tl.zeros((MPAD,), dtype=tl.float32)
    rstd = tl.zeros((MPAD,), dtype=tl.float32)
    start = 0
    if PDL:  # the first tile by plain loads (they do not block), then the wait for the kernel before
        w_first = _first_tile_then_wait(w_ptr, pid, N, K, offs_k, BLOCK_N, EVEN_K, False)
        outs, sq = _tile_rows(w_first, 0, K, offs_k, cols_m, M, x_ptr, r_ptr, nw_ptr, outs, sq, NORM, HAS_RES, EVEN_K)
        start = 1
        if k_tiles == 1:
            rstd = _finish_rows(outs, sq, pid, M, N, K, eps, b_ptr, y_ptr, BLOCK_N, MPAD, NORM, HAS_BIAS)
            outs = tl.zeros((BLOCK_N, MPAD), dtype=tl.float32)
            sq = tl.zeros((MPAD,), dtype=tl.float32)
    for it in tl.range(start, total, num_stages=STAGES):
        j = it // k_tiles
        kt = it - j * k_tiles
        rb = pid + j * grid
        k = kt * BLOCK_K
        w = w_desc.load([rb * BLOCK_N, k])
        outs, sq = _tile_rows(w, k, K, offs_k, cols_m, M, x_ptr, r_ptr, nw_ptr, outs, sq, NORM, HAS_RES, EVEN_K)
        if kt == k_tiles - 1:
            rstd = _finish_rows(outs, sq, rb, M, N, K, eps, b_ptr, y_ptr, BLOCK_N, MPAD, NORM, HAS_BIAS)
            outs = tl.zeros((BLOCK_N, MPAD), dtype=tl.float32)
            sq = tl.zeros((MPAD,), dtype=tl.float32)
    if NORM and (HAS_RES or WRITE_NORMED):  # this program's slices of the new residual and of the normed rows
        offs_c = tl.arange(0, WRITE_BLOCK)
        for m in range(M):
            rstd_m = tl.sum(tl.where(cols_m == m, rstd, 0.0), axis=0)
            for c in range(pid * WRITE_BLOCK, K, grid * WRITE_BLOCK):
                c_mask = c + offs_c < K
                xc = tl.load(x_ptr + m * K + c + offs_c, mask=c_mask, other=0.0)
                if HAS_RES:
                    rc = tl.load(r_ptr + m * K + c + offs_c, mask=c_mask, other=0.0)
                    xc = (xc.to(tl.float32) + rc.to(tl.float32)).to(xc.dtype)
                    tl.store(res_out_ptr + m * K + c + offs_c, xc, mask=c_mask)
                if WRITE_NORMED:
                    nwc = tl.load(nw_ptr + c + offs_c, mask=c_mask, other=0.0).to(tl.float32)
                    tl.store(normed_ptr + m * K + c + offs_c, (xc.to(tl.float32) * rstd_m * nwc).to(xc.dtype),
                             mask=c_mask)


def rows_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``tma_supported`` for one row of x, up to 16 contiguous rows."""
    return 1 <= x.shape[0] <= MAX_ROWS and x.is_contiguous() and tma_supported(x[:1], weight)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    """The operands' shapes and layout (the interpreter runs the kernel too; ``rows_supported`` adds the device)."""
    ok = (x.dim() == 2 and weight.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[1]
          and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.is_contiguous()
          and weight.is_contiguous() and weight.shape[0] > 0 and weight.shape[1] * weight.element_size() % 16 == 0)
    if not ok:
        raise ValueError(f"the shared-tile TMA GEMV takes 1..{MAX_ROWS} contiguous 16-bit rows and a contiguous W "
                         f"of their dtype, got x {tuple(x.shape)} {x.dtype} and W {tuple(weight.shape)} {weight.dtype}")


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
            norm: tuple | None, overrides: dict[str, int | None], pdl: bool | None) -> None:
    (m, k), n = x.shape, weight.shape[0]
    cfg = tma_config(n, k, x.dtype, _sms(x), norm=norm is not None)
    cfg.update({key: v for key, v in overrides.items() if v is not None})
    bn, bk = cfg["block_n"], cfg["block_k"]
    if bn & (bn - 1) or bk & (bk - 1) or bk * x.element_size() < 16:
        raise ValueError(f"block_n {bn} / block_k {bk} must be powers of two, a tile row >= 16 bytes")
    grid = min(triton.cdiv(n, bn), cfg["programs_per_sm"] * _sms(x))
    desc = TensorDescriptor(weight, [n, k], [k, 1], [bn, bk])
    residual, nw, eps, res_out, normed = norm if norm is not None else (None, y, 0.0, y, None)
    launch = pdl_launch(x) if pdl is None else ({"PDL": True, "launch_pdl": True} if pdl else {})
    _gemv_tma_rows_shared_kernel[(grid,)](
        desc, weight, x, bias if bias is not None else y, y, residual if residual is not None else x, nw, res_out,
        normed if normed is not None else y, m, n, k, eps,
        HAS_BIAS=bias is not None, NORM=norm is not None, HAS_RES=residual is not None,
        WRITE_NORMED=normed is not None, EVEN_K=k % bk == 0, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg["stages"],
        WRITE_BLOCK=max(16, min(2048, triton.next_power_of_2(triton.cdiv(k, grid)))), MPAD=MAX_ROWS,
        num_warps=cfg["num_warps"], **launch)


def gemv_tma_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  block_n: int | None = None, block_k: int | None = None, stages: int | None = None,
                  programs_per_sm: int | None = None, num_warps: int | None = None,
                  pdl: bool | None = None) -> torch.Tensor:
    """``gemv_ref`` for x [1..16, K]; each row's bits independent of the other rows."""
    _check(x, weight)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    overrides = {"block_n": block_n, "block_k": block_k, "stages": stages, "programs_per_sm": programs_per_sm,
                 "num_warps": num_warps}
    _launch(x, weight, None if bias is None else bias.contiguous(), y, None, overrides, pdl)
    return y


def gemv_norm_tma_rows(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None, write_normed: bool = False, *,
                       block_n: int | None = None, block_k: int | None = None, stages: int | None = None,
                       programs_per_sm: int | None = None, num_warps: int | None = None,
                       pdl: bool | None = None) -> NormedProjection:
    """``gemv_norm_ref`` (residual-add RMSNorm, then the projection) in one launch, rows independent."""
    _check(x, weight)
    if norm_weight.shape != (x.shape[1],) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} / residual shape do not match x {tuple(x.shape)}")
    r = None if residual is None else residual.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    out = NormedProjection(y, x if r is None else torch.empty_like(x), torch.empty_like(x) if write_normed else None)
    overrides = {"block_n": block_n, "block_k": block_k, "stages": stages, "programs_per_sm": programs_per_sm,
                 "num_warps": num_warps}
    _launch(x, weight, None if bias is None else bias.contiguous(), y,
            (r, norm_weight.contiguous(), eps, out.residual, out.normed), overrides, pdl)
    return out
