"""The FP8 GEMV's one-row program whose K tiles span several scale columns (``GROUPED``), and the epilogue both of
its programs end with: split out of ``kernels/triton_fp8_gemv.py``, which launches them.

A GROUPED tile is ``[BLOCK_N, G, SC]``: BLOCK_K = G * SC columns in G chunks, each inside one scale column. The rows
of a program share one scale row, so each chunk's scale multiplies x's columns under it (a multiplication per
activation, not per weight) and the tile is as wide as the 16-bit kernel's whatever the scale blocks' width.
"""

from __future__ import annotations

from kernels.triton_compat import pdl_wait, tl
from kernels.triton_compat import jit as _jit


@_jit
def _load_grouped_tile(w_base, k, K, offs_gc, EVEN_K: tl.constexpr):
    if EVEN_K:
        w = tl.load(w_base + k)
    else:
        w = tl.load(w_base + k, mask=(k + offs_gc < K)[None, :, :], other=0.0)
    return w


@_jit
def _grouped_sub_tile(w, k, K, offs_gc, offs_g, x_ptr, r_ptr, nw_ptr, s_row, scale_ncols, acc, squares,
                      NORM: tl.constexpr, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr, SC: tl.constexpr):
    """acc [BLOCK_N, G, SC] += W's [BLOCK_N, G, SC] tile at column k times x's [G, SC] tile scaled by the G scale
    columns the tile spans (one scale row holds every row of the program's tile). x is scaled, not W: a
    multiplication per activation, not per weight. With NORM, x's tile is ``(x (+ r)) * nw`` and its squares are
    summed into ``squares``, as ``_accumulate_tile`` does."""
    k_mask = k + offs_gc < K
    if EVEN_K:
        x_in = tl.load(x_ptr + k + offs_gc)
    else:
        x_in = tl.load(x_ptr + k + offs_gc, mask=k_mask, other=0.0)
    xs = x_in.to(tl.float32)
    if NORM:
        if HAS_RES:  # the sum rounded to the activation dtype first, as the torch add does
            if EVEN_K:
                r = tl.load(r_ptr + k + offs_gc)
            else:
                r = tl.load(r_ptr + k + offs_gc, mask=k_mask, other=0.0)
            xs = (xs + r.to(tl.float32)).to(x_in.dtype).to(tl.float32)
        squares += xs * xs
        xs = xs * tl.load(nw_ptr + k + offs_gc, mask=k_mask, other=0.0).to(tl.float32)
    s = tl.load(s_row + tl.minimum(k // SC + offs_g, scale_ncols - 1))  # clamped as in ``_fp8_sub_tile``
    acc += w.to(tl.float32) * (xs * s[:, None])[None, :, :]
    return acc, squares


@_jit
def fp8_grouped_program(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, ws_split_stride, tile, n_rows, N, K, k_split, x_s0, s_s0,
    scale_rows, scale_ncols, r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, eps, write_programs,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SC: tl.constexpr, K_SUB: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    WRITE: tl.constexpr, WRITE_NORMED: tl.constexpr, WRITE_BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row of x (M = 1) against fp8 rows [tile*BLOCK_N, +BLOCK_N) over K range [pid_k*k_split, +k_split) in
    tiles of BLOCK_K = G * SC columns that span G scale columns: BLOCK_N divides the scale block's rows, so the
    tile's rows share one scale row and each scale column's scale multiplies x's columns under it. Tiles as wide as
    the 16-bit kernel's, whatever the scale blocks' width: the same bytes a load, the same bytes in flight."""
    G: tl.constexpr = BLOCK_K // SC
    pid_k = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, n_rows - 1).to(tl.int64)
    offs_g = tl.arange(0, G)
    offs_gc = offs_g[:, None] * SC + tl.arange(0, SC)[None, :]
    w_base = w_ptr + rows_n[:, None, None] * K + offs_gc[None, :, :]
    s_row = s_ptr + ((tile * BLOCK_N) // scale_rows) * s_s0
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    acc = tl.zeros((BLOCK_N, G, SC), dtype=tl.float32)
    squares = tl.zeros((G, SC), dtype=tl.float32)
    k_start = k_lo
    if PREFETCH:
        w_first = _load_grouped_tile(w_base, k_lo, K, offs_gc, EVEN_K)
    pdl_wait(PDL)
    if PREFETCH:
        acc, squares = _grouped_sub_tile(w_first, k_lo, K, offs_gc, offs_g, x_ptr, r_ptr, nw_ptr, s_row,
                                         scale_ncols, acc, squares, NORM, HAS_RES, EVEN_K, SC)
        for j in tl.static_range(1, K_SUB):
            kk = k_lo + j * BLOCK_K
            w = _load_grouped_tile(w_base, kk, K, offs_gc, EVEN_K)
            acc, squares = _grouped_sub_tile(w, kk, K, offs_gc, offs_g, x_ptr, r_ptr, nw_ptr, s_row, scale_ncols,
                                             acc, squares, NORM, HAS_RES, EVEN_K, SC)
        k_start += BLOCK_K * K_SUB
    for k in range(k_start, k_hi, BLOCK_K * K_SUB):
        for j in tl.static_range(K_SUB):
            kk = k + j * BLOCK_K
            w = _load_grouped_tile(w_base, kk, K, offs_gc, EVEN_K)
            acc, squares = _grouped_sub_tile(w, kk, K, offs_gc, offs_g, x_ptr, r_ptr, nw_ptr, s_row, scale_ncols,
                                             acc, squares, NORM, HAS_RES, EVEN_K, SC)
    out = tl.sum(tl.sum(acc, axis=2), axis=1)[:, None]
    offs_m = tl.arange(0, 1)
    rstd = tl.zeros((1,), dtype=tl.float32)
    if NORM:
        rstd += 1.0 / tl.sqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / K + eps)
    fp8_epilogue(out, rstd, offs_n, offs_m, offs_m, n_rows, 0, N, 1, K, pid_k, x_ptr, x_s0, b_ptr, y_ptr, ws_ptr,
                  ws_split_stride, r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, tile, write_programs, HAS_BIAS,
                  SPLIT, NORM, HAS_RES, WRITE, WRITE_NORMED, WRITE_BLOCK)


@_jit
def fp8_epilogue(out, rstd, offs_n, offs_m, rows_m, n_rows, col0, N, M, K, pid_k, x_ptr, x_s0, b_ptr, y_ptr, ws_ptr,
                  ws_split_stride, r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, write_pid, write_programs,
                  HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                  WRITE: tl.constexpr, WRITE_NORMED: tl.constexpr, WRITE_BLOCK: tl.constexpr):
    """out [BLOCK_N, BLOCK_M] (rows x x-rows) into y columns ``col0 + offs_n``: the fp32 partial to the split's
    workspace, or scaled by 1/rms (NORM, ``rstd`` [BLOCK_M]) plus bias, rounded to x's dtype and stored in y's.
    WRITE: this program's share of the new residual and normed rows."""
    cols = col0 + offs_n
    out_mask = (offs_n < n_rows)[:, None] & (offs_m < M)[None, :]
    if SPLIT:
        tl.store(ws_ptr + pid_k * ws_split_stride + offs_m[None, :] * N + cols[:, None], out, mask=out_mask)
    else:
        if NORM:
            out = out * rstd[None, :]
        if HAS_BIAS:
            out += tl.load(b_ptr + cols, mask=offs_n < n_rows, other=0.0).to(tl.float32)[:, None]
        y = out.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)  # x's precision, y's dtype (logits: fp32)
        tl.store(y_ptr + offs_m[None, :] * N + cols[:, None], y, mask=out_mask)
    if WRITE:
        offs_c = tl.arange(0, WRITE_BLOCK)
        for c in range(write_pid * WRITE_BLOCK, K, write_programs * WRITE_BLOCK):
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
