"""Row-invariant persistent GEMV ``y[M, N] = x[M, K] @ W[N, K]^T`` for 1..16 rows: TMA weight tiles, tensor cores.

Why it exists: a speculative verify row must give each token the bits a one-token decode row gives it. The FMA
kernels (kernels/triton_gemv_tma.py, kernels/triton_gemv.py) reduce a row over K in a layout chosen for one row, so
several rows either loop over the one-row program (a verify row then costs about a decode step per token) or sum in
another order. Here every row count runs one binary with the rows padded to 16: ``tl.dot(W tile, x tile^T)`` puts
the rows on the MMA's N axis, and an output column (a row of x) accumulates over K in the MMA's fixed order from
that row's values alone (padded rows are zeros). A verify row of up to 16 tokens then costs about what one token
costs (the weight streams once), and each token keeps its one-row bits.

The schedule is the TMA kernel's: at most a few programs an SM walk their row blocks' [BLOCK_N, BLOCK_K] tiles in
one flat pipelined loop of tensor-descriptor loads; under dependent launch the first tile is read before the wait.
NORM: the residual-add RMSNorm in the K loop (each row's squares summed over K once per row block; the normed row
rounded to W's dtype for the tensor cores), the new residual and the normed rows written after the loop.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import INTERPRET, pdl_launch, tl, triton
from kernels.triton_compat import jit as _jit
from kernels.triton_gemv import NormedProjection
from kernels.triton_gemv_tma import TensorDescriptor, _first_tile_then_wait, _sms, tma_supported

ROWS = 16  # x's rows are padded to this (the MMA's N axis)


@_jit
def _dot_tile(w, k, K, offs_k, offs_m, M, x_ptr, r_ptr, nw_ptr, acc, squares,
              NORM: tl.constexpr, HAS_RES: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc [BLOCK_N, ROWS] += W tile @ x tile^T (rows >= M zero); with NORM x's tile is ``round((x + r) * nw)`` and
    its squares are summed into ``squares`` [ROWS, BLOCK_K]."""
    cols = k + offs_k
    mask = (offs_m < M)[:, None] & (cols < K)[None, :]
    at = offs_m[:, None] * K + cols[None, :]
    x_in = tl.load(x_ptr + at, mask=mask, other=0.0)
    xt = x_in
    if NORM:
        xs = x_in.to(tl.float32)
        if HAS_RES:  # the sum rounded to the activation dtype first, as the torch add does
            r = tl.load(r_ptr + at, mask=mask, other=0.0)
            xs = (xs + r.to(tl.float32)).to(x_in.dtype).to(tl.float32)
        squares += xs * xs
        nw = tl.load(nw_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        xt = (xs * nw[None, :]).to(w.dtype)
    if DOT_FP32:  # the interpreter's dot has no 16-bit path
        return tl.dot(w.to(tl.float32), tl.trans(xt.to(tl.float32)), acc, input_precision="ieee"), squares
    return tl.dot(w, tl.trans(xt), acc), squares


@_jit
def _finish_block(acc, squares, rb, M, N, K, eps, b_ptr, y_ptr, BLOCK_N: tl.constexpr, ROWS_: tl.constexpr,
                  NORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Scale row block ``rb``'s [BLOCK_N, ROWS] outputs by each row's 1/rms (NORM), add the bias, store the rows
    < M; returns the rows' 1/rms."""
    offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, ROWS_)
    out = acc
    rstd = tl.sum(squares, axis=1)  # unused without NORM
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + eps)
        out = out * rstd[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    tl.store(y_ptr + offs_m[None, :] * N + offs_n[:, None], out.to(y_ptr.dtype.element_ty), mask=mask)
    return rstd


@_jit(do_not_specialize=["M"])
def _gemv_tma_dot_kernel(
    w_desc, w_ptr, x_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, res_out_ptr, normed_ptr, M, N, K, eps,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, WRITE_NORMED: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    WRITE_BLOCK: tl.constexpr, ROWS_: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program pid: row blocks pid, pid + grid, ... of W, their K tiles in one pipelined loop (it -> row block
    it // k_tiles, K tile it % k_tiles); a row block's last tile stores its [BLOCK_N, M] outputs. M is not
    specialised: one binary for every row count."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, grid) * k_tiles  # the launch keeps grid <= row blocks
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, ROWS_)
    acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)
    squares = tl.zeros((ROWS_, BLOCK_K), dtype=tl.float32)
    rstd = tl.zeros((ROWS_,), dtype=tl.float32)
    start = 0
    if PDL:  # the first tile by plain loads (they do not block), then the wait for the kernel before
        w_first = _first_tile_then_wait(w_ptr, pid, N, K, offs_k, BLOCK_N, EVEN_K, False)
        acc, squares = _dot_tile(w_first, 0, K, offs_k, offs_m, M, x_ptr, r_ptr, nw_ptr, acc, squares, NORM, HAS_RES,
                                 DOT_FP32)
        start = 1
        if k_tiles == 1:
            rstd = _finish_block(acc, squares, pid, M, N, K, eps, b_ptr, y_ptr, BLOCK_N, ROWS_, NORM, HAS_BIAS)
            acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)
            squares = tl.zeros((ROWS_, BLOCK_K), dtype=tl.float32)
    for it in tl.range(start, total, num_stages=STAGES):
        j = it // k_tiles
        kt = it - j * k_tiles
        rb = pid + j * grid
        k = kt * BLOCK_K
        w = w_desc.load([rb * BLOCK_N, k])
        acc, squares = _dot_tile(w, k, K, offs_k, offs_m, M, x_ptr, r_ptr, nw_ptr, acc, squares, NORM, HAS_RES,
                                 DOT_FP32)
        if kt == k_tiles - 1:
            rstd = _finish_block(acc, squares, rb, M, N, K, eps, b_ptr, y_ptr, BLOCK_N, ROWS_, NORM, HAS_BIAS)
            acc = tl.zeros((BLOCK_N, ROWS_), dtype=tl.float32)
            squares = tl.zeros((ROWS_, BLOCK_K), dtype=tl.float32)
    if NORM and (HAS_RES or WRITE_NORMED):  # this program's slices of the new residual and of the normed rows
        offs_c = tl.arange(0, WRITE_BLOCK)
        for c in range(pid * WRITE_BLOCK, K, grid * WRITE_BLOCK):
            mask = (offs_m < M)[:, None] & (c + offs_c < K)[None, :]
            at = offs_m[:, None] * K + (c + offs_c)[None, :]
            xc = tl.load(x_ptr + at, mask=mask, other=0.0)
            if HAS_RES:
                rc = tl.load(r_ptr + at, mask=mask, other=0.0)
                xc = (xc.to(tl.float32) + rc.to(tl.float32)).to(xc.dtype)
                tl.store(res_out_ptr + at, xc, mask=mask)
            if WRITE_NORMED:
                nwc = tl.load(nw_ptr + c + offs_c, mask=c + offs_c < K, other=0.0).to(tl.float32)
                tl.store(normed_ptr + at, (xc.to(tl.float32) * rstd[:, None] * nwc[None, :]).to(xc.dtype),
                         mask=mask)


def dot_config(n: int, k: int, dtype: torch.dtype, norm: bool = False) -> dict[str, int]:
    """Launch parameters from the shape alone (deterministic, CUDA-graph safe; never from M: every row count must
    run the same binary). 16 KiB [16, 512] tiles (the MMA's smallest M), 3 stages, 4 programs an SM."""
    block_k = min(1024 // dtype.itemsize, max(16, triton.next_power_of_2(k)))
    return {"block_n": 16, "block_k": block_k, "stages": 3, "programs_per_sm": 4, "num_warps": 4}


def dot_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``tma_supported`` for one row of x, up to 16 contiguous rows."""
    return 1 <= x.shape[0] <= ROWS and x.is_contiguous() and tma_supported(x[:1], weight)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
            norm: tuple | None, overrides: dict[str, int | None], pdl: bool | None) -> None:
    (m, k), n = x.shape, weight.shape[0]
    cfg = dot_config(n, k, x.dtype, norm is not None)
    cfg.update({key: v for key, v in overrides.items() if v is not None})
    bn, bk = cfg["block_n"], cfg["block_k"]
    if bn & (bn - 1) or bk & (bk - 1) or min(bn, bk) < 16:
        raise ValueError(f"block_n {bn} / block_k {bk} must be powers of two >= 16")
    grid = min(triton.cdiv(n, bn), cfg["programs_per_sm"] * _sms(x))
    desc = TensorDescriptor(weight, [n, k], [k, 1], [bn, bk])
    residual, nw, eps, res_out, normed = norm if norm is not None else (None, y, 0.0, y, None)
    launch = pdl_launch(x) if pdl is None else ({"PDL": True, "launch_pdl": True} if pdl else {})
    _gemv_tma_dot_kernel[(grid,)](
        desc, weight, x, bias if bias is not None else y, y, residual if residual is not None else x, nw, res_out,
        normed if normed is not None else y, m, n, k, eps,
        HAS_BIAS=bias is not None, NORM=norm is not None, HAS_RES=residual is not None,
        WRITE_NORMED=normed is not None, EVEN_K=k % bk == 0, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg["stages"],
        WRITE_BLOCK=max(16, min(512, triton.next_power_of_2(triton.cdiv(k, grid)))), ROWS_=ROWS,
        DOT_FP32=INTERPRET, num_warps=cfg["num_warps"], **launch)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    """The operands' shapes and layout (the interpreter runs the kernel too; ``dot_supported`` adds the device)."""
    ok = (x.dim() == 2 and weight.dim() == 2 and 1 <= x.shape[0] <= ROWS and x.shape[1] == weight.shape[1]
          and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.is_contiguous()
          and weight.is_contiguous() and weight.shape[0] > 0 and weight.shape[1] * weight.element_size() % 16 == 0)
    if not ok:
        raise ValueError(f"the row-invariant TMA GEMV takes 1..{ROWS} contiguous 16-bit rows on a Hopper+ GPU and "
                         f"a contiguous 16-byte-aligned W of their dtype, got x {tuple(x.shape)} {x.dtype} and W "
                         f"{tuple(weight.shape)} {weight.dtype}")


def gemv_tma_dot(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 block_n: int | None = None, block_k: int | None = None, stages: int | None = None,
                 programs_per_sm: int | None = None, num_warps: int | None = None,
                 pdl: bool | None = None) -> torch.Tensor:
    """``gemv_ref`` for x [1..16, K] (see ``dot_supported``); each row's bits independent of the other rows."""
    _check(x, weight)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    overrides = {"block_n": block_n, "block_k": block_k, "stages": stages, "programs_per_sm": programs_per_sm,
                 "num_warps": num_warps}
    _launch(x, weight, None if bias is None else bias.contiguous(), y, None, overrides, pdl)
    return y


def gemv_norm_tma_dot(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
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
