"""Register-resident GEMV ``y[M, N] = x[M, K] @ W[N, K]^T`` for decode rows: each program holds its whole slice of
W in registers, loaded before the dependent-launch wait.

Why it exists: at batch 1 the output projection after a decode attention or a Gated DeltaNet step (2048 x 4096,
16.8 MB) runs at ~2.4 TB/s, latency-bound even from L2, while the kernels before it (attention split and reduce,
the delta-rule step) read little and leave DRAM idle for several microseconds a layer. Here the grid is one wave
(at most one program an SM, ROWS rows of W each, <= ``RESIDENT_BYTES`` of bf16 = half the register file): under
programmatic dependent launch every program issues the loads of all its weight bytes, lets the next kernel launch,
and only then waits for the kernel before. The weight streams while the attention runs; after the wait a
program reads x and sums from registers. W must be a weight (never written during a step).

Every row runs the same loop body of the same binary (M is not specialised), so a verify row's bits equal a
one-token decode row's by construction (exact speculation). The body converts the resident weight through an
opaque register move: the compiler must not hoist the fp32 conversion out of the row loop, which would need the
whole register file.

``gemv_triton`` dispatches here (``resident_for``) for single rows and row loops of 16-bit weights whose slice fits,
on GPUs with dependent launch; ``CONVEYOR_GEMV_RESIDENT=0`` never does.
"""

from __future__ import annotations

import os

import torch

from kernels.triton_compat import INTERPRET, pdl_launch, pdl_wait, tl, triton
from kernels.triton_compat import jit as _jit

RESIDENT = os.environ.get("CONVEYOR_GEMV_RESIDENT", "1") == "1"
RESIDENT_BYTES = 128 * 1024  # a program's slice of W: half of an SM's 256 KiB register file
NUM_WARPS = 16  # 128 KiB over 512 threads: 64 registers a thread of packed weights
MAX_ROWS = 16  # the row loop's rows (speculative verify rows; SKINNY_MAX_M)
MAXNREG = int(os.environ.get("CONVEYOR_GEMV_RESIDENT_MAXNREG", "0")) or None


@_jit
def _opaque(w, OPAQUE: tl.constexpr):
    """w unchanged, through a volatile register move the compiler cannot hoist out of a loop (compiled only)."""
    if OPAQUE:
        bits = tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [w.to(tl.int16, bitcast=True)],
                                         dtype=tl.int16, is_pure=False, pack=1)
        w = bits.to(w.dtype, bitcast=True)
    return w


@_jit(do_not_specialize=["M"])
def _gemv_resident_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_s0,
                          HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                          OPAQUE: tl.constexpr, PDL: tl.constexpr = False):
    """Program pid: rows [pid*ROWS, +ROWS) of W, all of K (BLOCK_K >= K), loaded before the wait; then for each of
    the M rows of x the same dot products, reduced over K once."""
    pid = tl.program_id(0)
    offs_n = pid * ROWS + tl.arange(0, ROWS)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: out-of-range rows re-read the last, never stored
    offs_k = tl.arange(0, BLOCK_K)
    if EVEN_K:
        w = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :])
    else:
        w = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
    pdl_wait(PDL)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    for m in range(M):
        if EVEN_K:
            x = tl.load(x_ptr + m * x_s0 + offs_k)
        else:
            x = tl.load(x_ptr + m * x_s0 + offs_k, mask=offs_k < K, other=0.0)
        out = tl.sum(_opaque(w, OPAQUE).to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            out += bias
        tl.store(y_ptr + m * N + offs_n, out.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def resident_rows(n: int, k: int, dtype: torch.dtype, num_sms: int) -> int | None:
    """ROWS a program for W [n, k] in one wave of at most ``num_sms`` programs, or None when a program's slice
    (ROWS x the padded K) would pass ``RESIDENT_BYTES``."""
    rows = triton.next_power_of_2(triton.cdiv(n, num_sms))
    fits = rows * triton.next_power_of_2(k) * dtype.itemsize <= RESIDENT_BYTES
    return rows if fits else None


def resident_for(x: torch.Tensor, weight: torch.Tensor, num_sms: int, row_loop: bool) -> bool:
    """Whether ``gemv_triton`` sends this call here: ``RESIDENT`` on, a CUDA device with dependent launch (without
    it the early weight loads have nothing to overlap), one row (or a row loop), 16-bit, the slice fitting."""
    if not RESIDENT or not x.is_cuda or not pdl_launch(x) or (x.shape[0] != 1 and not row_loop):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return False
    return resident_rows(weight.shape[0], weight.shape[1], x.dtype, num_sms) is not None


def gemv_resident(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, num_sms: int = 132,
                  pdl: bool | None = None) -> torch.Tensor:
    """``gemv_ref`` for x [M <= 16, K] and W [N, K] (16-bit, contiguous, its slice fitting ``resident_rows``); every
    row's bits those of its own one-row call. ``pdl`` (None: the device's default) dependent launch."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"need x [1..{MAX_ROWS}, K] and W [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"need 16-bit x and a contiguous W of its dtype, got {x.dtype} and {weight.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    rows = resident_rows(n, k, x.dtype, num_sms)
    if rows is None or n == 0:
        raise ValueError(f"W {tuple(weight.shape)} does not fit {num_sms} programs of {RESIDENT_BYTES} bytes")
    x = x if x.stride(1) == 1 else x.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch = pdl_launch(x) if pdl is None else ({"PDL": True, "launch_pdl": True} if pdl else {})
    block_k = triton.next_power_of_2(k)
    _gemv_resident_kernel[(triton.cdiv(n, rows),)](
        x, weight, bias if bias is not None else y, y, m, n, k, x.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k == block_k, ROWS=rows, BLOCK_K=block_k, OPAQUE=not INTERPRET,
        num_warps=NUM_WARPS, **({"maxnreg": MAXNREG} if MAXNREG else {}), **launch)
    return y
