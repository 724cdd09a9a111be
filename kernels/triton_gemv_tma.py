"""Persistent single-row GEMV ``y[1, N] = x[1, K] @ W[N, K]^T`` that streams W through shared memory by TMA.

Why it exists: batch-1 decode is bound by its projections, each reading a 17-50 MB weight once, past L2.
``_gemv_kernel`` (kernels/triton_gemv.py) keeps weight bytes in flight through occupancy: many small programs of
plain loads, each with a tile or two outstanding, which leaves a chain of large projections well short of the copy
bandwidth. Here the grid is at most a few programs per SM (``programs_per_sm``), each taking row blocks pid,
pid + grid, ... and walking their [BLOCK_N, BLOCK_K] tiles in one flattened loop whose Hopper tensor-descriptor
(TMA) loads the compiler pipelines STAGES deep into shared memory: tens of KB a program stay in flight whatever the
occupancy, the pipeline does not drain between row blocks and the tail is at most one row block. The math stays on
the CUDA cores (fp32 FMAs into a [BLOCK_N, BLOCK_K] accumulator, reduced once a row block).

NORM (``gemv_norm_tma``): the residual-add RMSNorm inside the K loop, exactly as ``_gemv_kernel`` does it. Under
dependent launch (PDL) each program loads its first W tile with plain loads (they do not block) before it waits
for the kernel before; W is a weight, never written during a step. The host descriptor is rebuilt per call: it
costs ~1 us of Python, and Triton's launcher encodes the TMA map from it at every launch anyway (a CUDA graph
keeps the encoded map). ``gemv_triton`` / ``gemv_norm_triton`` dispatch weights of ``GEMV_TMA_MIN_BYTES`` (32 MiB)
and more here, on the devices ``tma_supported`` accepts.
"""

from __future__ import annotations

import functools

import torch

from kernels.triton_compat import (
    INTERPRET,
    gdc_launch_dependents,
    gdc_wait,
    pdl_launch,
    tl,
    triton,
)
from kernels.triton_compat import jit as _jit
from kernels.triton_gemv import NormedProjection, _check_operands, _num_sms

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # no triton, or one without host tensor descriptors
    TensorDescriptor = None

SMEM_BYTES_PER_PROGRAM = 112 * 1024  # an override's STAGES x tile must fit twice in an SM (this and the next)


@_jit
def _accumulate(w, k, K, offs_k, x_ptr, r_ptr, nw_ptr, acc, squares,
                NORM: tl.constexpr, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr):
    """acc += W tile (columns k..) times x's tile; with NORM, x's tile is ``round(x + r) * nw`` and its squares
    are summed into ``squares`` (as ``_accumulate_tile`` of kernels/triton_gemv.py on its FMA path)."""
    if EVEN_K:
        x_in = tl.load(x_ptr + k + offs_k)
    else:
        x_in = tl.load(x_ptr + k + offs_k, mask=k + offs_k < K, other=0.0)
    xs = x_in.to(tl.float32)
    if NORM:
        if HAS_RES:  # the sum rounded to the activation dtype first, as the torch add does
            if EVEN_K:
                r = tl.load(r_ptr + k + offs_k)
            else:
                r = tl.load(r_ptr + k + offs_k, mask=k + offs_k < K, other=0.0)
            xs = (xs + r.to(tl.float32)).to(x_in.dtype).to(tl.float32)
        squares += xs * xs
        nw = tl.load(nw_ptr + k + offs_k, mask=k + offs_k < K, other=0.0).to(tl.float32)
        xs = xs * nw
    acc += w.to(tl.float32) * xs[None, :]
    return acc, squares


@_jit
def _finish_row_block(acc, squares, rb, N, K, eps, b_ptr, y_ptr, w_ptr,
                      BLOCK_N: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Reduce row block ``rb``'s accumulator over K, scale by 1/rms (NORM), add the bias, store rounded to the
    weight's dtype (``w_ptr`` is not read) as y's (logits: fp32); returns 1/rms."""
    offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    out = tl.sum(acc, axis=1)
    rstd = tl.sum(squares, axis=0)  # unused without NORM
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
        out = out * rstd
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, out.to(w_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=offs_n < N)
    return rstd


@_jit
def _first_tile_then_wait(w_ptr, pid, N, K, offs_k, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
                          LATE_TRIGGER: tl.constexpr):
    """Dependent launch: program pid's first W tile by plain loads (they do not block; W is never written in a
    step), the next kernel let go unless LATE_TRIGGER, then the wait for the kernel before."""
    rows = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    if EVEN_K:
        w_first = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :])
    else:
        w_first = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
    if not LATE_TRIGGER:
        gdc_launch_dependents()
    gdc_wait()
    return w_first


@_jit
def _gemv_tma_kernel(
    w_desc, w_ptr, x_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, res_out_ptr, normed_ptr, N, K, eps,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, WRITE_NORMED: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    WRITE_BLOCK: tl.constexpr, PDL: tl.constexpr = False, LATE_TRIGGER: tl.constexpr = False,
):
    """Program pid: row blocks pid, pid + grid, ... of W, their K tiles in one pipelined loop (it -> row block
    it // k_tiles, K tile it % k_tiles); a row block's last tile reduces and stores its BLOCK_N outputs.

    PDL: the first tile of the first row block is loaded with plain loads before the wait (weights only; x, the
    residual, the norm weight and the bias after it) and accumulated before the loop, which then starts at 1. The
    next kernel may launch at once (``gdc_launch_dependents`` before the wait) or, with LATE_TRIGGER, once this
    program's main loop is done."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, grid) * k_tiles  # the launch keeps grid <= row blocks
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    start = 0
    if PDL:  # plain loads of the first tile (they do not block), then the wait for the kernel before
        w_first = _first_tile_then_wait(w_ptr, pid, N, K, offs_k, BLOCK_N, EVEN_K, LATE_TRIGGER)
    rstd = tl.sum(squares, axis=0)
    if PDL:
        acc, squares = _accumulate(w_first, 0, K, offs_k, x_ptr, r_ptr, nw_ptr, acc, squares, NORM, HAS_RES, EVEN_K)
        start = 1
        if k_tiles == 1:
            rstd = _finish_row_block(acc, squares, pid, N, K, eps, b_ptr, y_ptr, w_ptr, BLOCK_N, NORM, HAS_BIAS)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for it in tl.range(start, total, num_stages=STAGES):
        j = it // k_tiles
        kt = it - j * k_tiles
        rb = pid + j * grid
        k = kt * BLOCK_K
        w = w_desc.load([rb * BLOCK_N, k])
        acc, squares = _accumulate(w, k, K, offs_k, x_ptr, r_ptr, nw_ptr, acc, squares, NORM, HAS_RES, EVEN_K)
        if kt == k_tiles - 1:
            rstd = _finish_row_block(acc, squares, rb, N, K, eps, b_ptr, y_ptr, w_ptr, BLOCK_N, NORM, HAS_BIAS)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    if PDL and LATE_TRIGGER:
        gdc_launch_dependents()
    if NORM and (HAS_RES or WRITE_NORMED):  # this program's slices of the new residual and of the normed row
        offs_c = tl.arange(0, WRITE_BLOCK)
        for c in range(pid * WRITE_BLOCK, K, grid * WRITE_BLOCK):
            c_mask = c + offs_c < K
            xc = tl.load(x_ptr + c + offs_c, mask=c_mask, other=0.0)
            if HAS_RES:
                rc = tl.load(r_ptr + c + offs_c, mask=c_mask, other=0.0)
                xc = (xc.to(tl.float32) + rc.to(tl.float32)).to(xc.dtype)
                tl.store(res_out_ptr + c + offs_c, xc, mask=c_mask)
            if WRITE_NORMED:
                nwc = tl.load(nw_ptr + c + offs_c, mask=c_mask, other=0.0).to(tl.float32)
                tl.store(normed_ptr + c + offs_c, (xc.to(tl.float32) * rstd * nwc).to(xc.dtype), mask=c_mask)


@_jit
def _gemv_tma_rows_kernel(
    w_desc, w_ptr, x_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, res_out_ptr, normed_ptr, rstd_ptr, M, N, K, eps,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, WRITE_NORMED: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    WRITE_BLOCK: tl.constexpr, PDL: tl.constexpr = False, LATE_TRIGGER: tl.constexpr = False,
):
    """``_gemv_tma_kernel`` for M rows (x, the residual and y contiguous [M, .]), each row's bits those of its own
    one-row launch: the flat loop runs (row block, row, K tile), so a row block's every row takes the same tiles
    in the same order into a fresh accumulator, and its W slice (BLOCK_N x K) is read again per row while it is
    still in L2. A row's 1/rms (NORM) goes through ``rstd_ptr`` ([grid, M]) to the residual and normed writes."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_block = M * k_tiles
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, grid) * per_block
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    start = 0
    if PDL:  # as the one-row kernel: row 0's first tile by plain loads before the wait
        w_first = _first_tile_then_wait(w_ptr, pid, N, K, offs_k, BLOCK_N, EVEN_K, LATE_TRIGGER)
        acc, squares = _accumulate(w_first, 0, K, offs_k, x_ptr, r_ptr, nw_ptr, acc, squares, NORM, HAS_RES, EVEN_K)
        start = 1
        if k_tiles == 1:
            rstd = _finish_row_block(acc, squares, pid, N, K, eps, b_ptr, y_ptr, w_ptr, BLOCK_N, NORM, HAS_BIAS)
            if NORM:
                tl.store(rstd_ptr + pid * M, rstd)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for it in tl.range(start, total, num_stages=STAGES):
        j = it // per_block
        m = (it - j * per_block) // k_tiles
        kt = it - j * per_block - m * k_tiles
        rb = pid + j * grid
        k = kt * BLOCK_K
        w = w_desc.load([rb * BLOCK_N, k])
        acc, squares = _accumulate(w, k, K, offs_k, x_ptr + m * K, r_ptr + m * K, nw_ptr, acc, squares, NORM,
                                   HAS_RES, EVEN_K)
        if kt == k_tiles - 1:
            rstd = _finish_row_block(acc, squares, rb, N, K, eps, b_ptr, y_ptr + m * N, w_ptr, BLOCK_N, NORM,
                                     HAS_BIAS)
            if NORM:
                tl.store(rstd_ptr + pid * M + m, rstd)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    if PDL and LATE_TRIGGER:
        gdc_launch_dependents()
    if NORM and (HAS_RES or WRITE_NORMED):
        tl.debug_barrier()  # this program's 1/rms stores, read back below
        offs_c = tl.arange(0, WRITE_BLOCK)
        for m in range(M):
            rstd = tl.load(rstd_ptr + pid * M + m)
            for c in range(pid * WRITE_BLOCK, K, grid * WRITE_BLOCK):
                c_mask = c + offs_c < K
                xc = tl.load(x_ptr + m * K + c + offs_c, mask=c_mask, other=0.0)
                if HAS_RES:
                    rc = tl.load(r_ptr + m * K + c + offs_c, mask=c_mask, other=0.0)
                    xc = (xc.to(tl.float32) + rc.to(tl.float32)).to(xc.dtype)
                    tl.store(res_out_ptr + m * K + c + offs_c, xc, mask=c_mask)
                if WRITE_NORMED:
                    nwc = tl.load(nw_ptr + c + offs_c, mask=c_mask, other=0.0).to(tl.float32)
                    tl.store(normed_ptr + m * K + c + offs_c, (xc.to(tl.float32) * rstd * nwc).to(xc.dtype),
                             mask=c_mask)


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def tma_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv_tma`` runs for these operands: a Hopper+ GPU (compiled Triton with host tensor descriptors,
    not the interpreter), one 16-bit activation row, W contiguous and 16-byte aligned with 16-byte rows."""
    if triton is None or TensorDescriptor is None or INTERPRET or not (x.is_cuda and weight.is_cuda):
        return False
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] != 1 or x.shape[1] != weight.shape[1] or 0 in weight.shape:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or not weight.is_contiguous():
        return False
    if weight.shape[1] * weight.element_size() % 16 or weight.data_ptr() % 16:
        return False
    return _capability_major(weight.device.index or 0) >= 9


def tma_config(n: int, k: int, dtype: torch.dtype, num_sms: int = 132, norm: bool = False) -> dict[str, int | bool]:
    """Launch parameters from the shape alone (deterministic, CUDA-graph safe). 16 KiB tiles, 3 stages (two tiles
    in flight while one is summed), 4 programs an SM (about 3 resident at ~155 registers a thread): without the
    norm [8, 1024], with it [32, 256], whose norm work (repeated for each row block) is spread over more rows
    (chosen in chains of one shape under PDL: 12352 x 2048 and the lm_heads).
    BLOCK_N halves (down to 4) while there are fewer row blocks than SMs."""
    elt = dtype.itemsize
    block_n, row_bytes = (32, 512) if norm else (8, 2048)
    block_k = min(row_bytes // elt, max(16 // elt, triton.next_power_of_2(k)))
    while block_n > 4 and triton.cdiv(n, block_n) < num_sms:
        block_n //= 2
    return {"block_n": block_n, "block_k": block_k, "stages": 3, "programs_per_sm": 4, "num_warps": 4,
            "late_trigger": False}


def _sms(x: torch.Tensor) -> int:
    return _num_sms(x.device.index or 0) if x.is_cuda else 132


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
            norm: tuple | None, overrides: dict[str, int | None], pdl: bool | None) -> None:
    """One launch of ``_gemv_tma_kernel``; ``norm`` = (residual or None, norm weight, eps, residual out, normed
    out or None) for the fused RMSNorm."""
    n, k = weight.shape
    cfg = tma_config(n, k, x.dtype, _sms(x), norm=norm is not None)
    cfg.update({key: v for key, v in overrides.items() if v is not None})
    bn, bk = cfg["block_n"], cfg["block_k"]
    if bn & (bn - 1) or bk & (bk - 1) or bk * x.element_size() < 16:
        raise ValueError(f"block_n {bn} / block_k {bk} must be powers of two, a tile row >= 16 bytes")
    if cfg["stages"] * bn * bk * x.element_size() > SMEM_BYTES_PER_PROGRAM:
        raise ValueError(f"{cfg['stages']} stages of [{bn}, {bk}] exceed {SMEM_BYTES_PER_PROGRAM} bytes")
    grid = min(triton.cdiv(n, bn), cfg["programs_per_sm"] * _sms(x))
    desc = TensorDescriptor(weight, [n, k], [k, 1], [bn, bk])
    residual, nw, eps, res_out, normed = norm if norm is not None else (None, y, 0.0, y, None)
    launch = pdl_launch(x) if pdl is None else ({"PDL": True, "launch_pdl": True} if pdl else {})
    args = (desc, weight, x, bias if bias is not None else y, y, residual if residual is not None else x, nw,
            res_out, normed if normed is not None else y)
    options = dict(HAS_BIAS=bias is not None, NORM=norm is not None, HAS_RES=residual is not None,
                   WRITE_NORMED=normed is not None, EVEN_K=k % bk == 0, BLOCK_N=bn, BLOCK_K=bk,
                   STAGES=cfg["stages"], WRITE_BLOCK=max(16, min(2048, triton.next_power_of_2(triton.cdiv(k, grid)))),
                   LATE_TRIGGER=bool(launch) and bool(cfg["late_trigger"]), num_warps=cfg["num_warps"], **launch)
    if x.shape[0] == 1:
        _gemv_tma_kernel[(grid,)](*args, n, k, eps, **options)
    else:  # each row as its own one-row launch would compute it
        rstd = torch.empty(grid * x.shape[0] if norm is not None else 1, dtype=torch.float32, device=x.device)
        _gemv_tma_rows_kernel[(grid,)](*args, rstd, x.shape[0], n, k, eps, **options)


def _check_one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_loop: bool) -> None:
    _check_operands(x, weight, bias)
    if (x.shape[0] != 1 and not row_loop) or x.dtype not in (torch.bfloat16, torch.float16) or 0 in weight.shape:
        raise ValueError(f"the TMA GEMV takes one 16-bit row (several with row_loop) and a non-empty W, got x "
                         f"{tuple(x.shape)} {x.dtype} and W {tuple(weight.shape)}")


def gemv_tma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             block_n: int | None = None, block_k: int | None = None, stages: int | None = None,
             programs_per_sm: int | None = None, num_warps: int | None = None, late_trigger: bool | None = None,
             pdl: bool | None = None, row_loop: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``gemv_ref`` for x [1, K] and W [N, K] (16-bit, contiguous; see ``tma_supported``); keywords override
    ``tma_config``, ``pdl`` (None: the device's default) dependent launch. W must be a weight: under PDL its first
    tile is read before the kernels before this one have finished. ``row_loop``: x may have up to 16 rows, each
    computed as a one-row call computes it (``_gemv_tma_rows_kernel``). ``out_dtype``: as ``gemv_triton``'s."""
    _check_one_row(x, weight, bias, row_loop)
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    overrides = {"block_n": block_n, "block_k": block_k, "stages": stages, "programs_per_sm": programs_per_sm,
                 "num_warps": num_warps, "late_trigger": late_trigger}
    _launch(x, weight, None if bias is None else bias.contiguous(), y, None, overrides, pdl)
    return y


def gemv_norm_tma(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, write_normed: bool = False, *,
                  block_n: int | None = None, block_k: int | None = None, stages: int | None = None,
                  programs_per_sm: int | None = None, num_warps: int | None = None,
                  late_trigger: bool | None = None, pdl: bool | None = None,
                  row_loop: bool = False) -> NormedProjection:
    """``gemv_norm_ref`` (residual-add RMSNorm, then the projection) in one launch of the TMA kernel;
    ``row_loop`` as ``gemv_tma``'s."""
    _check_one_row(x, weight, bias, row_loop)
    if norm_weight.shape != (x.shape[1],) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} / residual shape do not match x {tuple(x.shape)}")
    x = x.contiguous()
    r = None if residual is None else residual.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    out = NormedProjection(y, x if r is None else torch.empty_like(x), torch.empty_like(x) if write_normed else None)
    overrides = {"block_n": block_n, "block_k": block_k, "stages": stages, "programs_per_sm": programs_per_sm,
                 "num_warps": num_warps, "late_trigger": late_trigger}
    _launch(x, weight, None if bias is None else bias.contiguous(), y,
            (r, norm_weight.contiguous(), eps, out.residual, out.normed), overrides, pdl)
    return out
