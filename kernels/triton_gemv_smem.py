"""Shared-memory-resident GEMV ``y[M, N] = x[M, K] @ W[N, K]^T`` for decode rows (Gluon, Hopper+).

Why it exists: at batch 1 the output projection after a decode attention or a Gated DeltaNet step (2048 x 4096,
16.8 MB) is latency-bound, while the kernels before it read little and leave DRAM idle for microseconds a layer.
Here one wave of programs (at most one an SM) each copies its whole [ROWS, K] slice of W into shared memory by TMA
(``SMEM_BYTES`` at most), lets the next kernel launch and only then waits for the kernel before (programmatic
dependent launch): the weight streams while the kernels before run, and the registers stay free for them (a
register-resident variant could not share an SM with the attention kernels; bench/README.md). After the wait a
program reads x and sums from shared memory.

Every row of x runs the same loop body of the same binary (M is not specialised): a verify row's bits are those of
a one-token decode row (exact speculation). W must be a weight (never written during a step).
"""

from __future__ import annotations

import functools
import os

import torch

from kernels.triton_compat import INTERPRET, triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # no triton, or one without Gluon: the dispatch never comes here
    gluon = None

SMEM = os.environ.get("CONVEYOR_GEMV_SMEM", "1") == "1"
SMEM_BYTES = 128 * 1024  # a program's slice of W, in shared memory (an SM has 228 KiB)
BLOCK_K = 256  # one TMA box is [ROWS, 256]: 512-byte rows, no swizzle (each warp reads a row's 512 contiguous bytes)
NUM_WARPS = 4
MAX_ROWS = 16  # rows of x (speculative verify rows; SKINNY_MAX_M)

if gluon is not None:

    @gluon.jit
    def _gdc(LAUNCH: gl.constexpr):
        if LAUNCH:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit(do_not_specialize=["M"])
    def _gemv_smem_kernel(w_desc, x_ptr, b_ptr, y_ptr, M, N, K, x_s0,
                          HAS_BIAS: gl.constexpr, ROWS: gl.constexpr, BLOCK_K: gl.constexpr, K_TILES: gl.constexpr,
                          NUM_WARPS: gl.constexpr, PDL: gl.constexpr):
        """Program pid: rows [pid*ROWS, +ROWS) of W, K_TILES boxes of [ROWS, BLOCK_K], each on its own barrier,
        all issued before the wait; then per row of x the tiles in order, FMAs into a [ROWS, BLOCK_K] fp32
        accumulator reduced over K once."""
        pid = gl.program_id(0)
        row0 = pid * ROWS
        smem = gl.allocate_shared_memory(w_desc.dtype, [K_TILES, ROWS, BLOCK_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [K_TILES, 1], mbarrier.MBarrierLayout())
        for t in gl.static_range(K_TILES):
            mbarrier.init(bars.index(t), count=1)
        for t in gl.static_range(K_TILES):
            mbarrier.expect(bars.index(t), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [row0, t * BLOCK_K], bars.index(t), smem.index(t))
        if PDL:
            _gdc(True)
            _gdc(False)
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
        offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
        offs_n = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        if HAS_BIAS:
            bias = gl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
        for m in range(M):
            acc = gl.zeros([ROWS, BLOCK_K], gl.float32, layout)
            for t in gl.static_range(K_TILES):
                mbarrier.wait(bars.index(t), 0)
                w = smem.index(t).load(layout)
                x = gl.load(x_ptr + m * x_s0 + t * BLOCK_K + offs_k)
                acc += w.to(gl.float32) * gl.expand_dims(x.to(gl.float32), 0)
            out = gl.sum(acc, axis=1)
            if HAS_BIAS:
                out += bias
            gl.store(y_ptr + m * N + offs_n, out.to(y_ptr.dtype.element_ty), mask=offs_n < N)
        for t in gl.static_range(K_TILES):
            mbarrier.invalidate(bars.index(t))


def smem_rows(n: int, k: int, dtype: torch.dtype, num_sms: int) -> int | None:
    """ROWS a program for W [n, k] in one wave of at most ``num_sms`` programs, or None: K not a multiple of
    ``BLOCK_K``, or a slice past ``SMEM_BYTES``."""
    rows = triton.next_power_of_2(triton.cdiv(n, num_sms))
    fits = k % BLOCK_K == 0 and rows * k * dtype.itemsize <= SMEM_BYTES and rows <= 256
    return rows if fits else None


@functools.cache
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def smem_for(x: torch.Tensor, weight: torch.Tensor, num_sms: int, row_loop: bool, pdl: bool) -> bool:
    """Whether ``gemv_triton`` sends this call here: ``SMEM`` on, Gluon present, a Hopper+ GPU with dependent
    launch (without it the early copies have nothing to overlap), one row (or a row loop), 16-bit, the slice
    fitting, W 16-byte aligned."""
    if not SMEM or gluon is None or INTERPRET or not pdl or not x.is_cuda or (x.shape[0] != 1 and not row_loop):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or not weight.is_contiguous():
        return False
    if weight.data_ptr() % 16 or x.stride(1) != 1 or _capability_major(x.device.index or 0) < 9:
        return False
    return smem_rows(weight.shape[0], weight.shape[1], x.dtype, num_sms) is not None


def gemv_smem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, num_sms: int,
              pdl: bool = True) -> torch.Tensor:
    """``gemv_ref`` for x [M <= 16, K] and W [N, K] (see ``smem_for``); every row's bits those of its own one-row
    call."""
    (m, k), n = x.shape, weight.shape[0]
    rows = smem_rows(n, k, x.dtype, num_sms)
    if gluon is None or rows is None or not 1 <= m <= MAX_ROWS or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and W {tuple(weight.shape)} are not for the shared-memory GEMV")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * x.element_size(), rank=2)
    desc = TensorDescriptor(weight, [n, k], [k, 1], [rows, BLOCK_K], layout)
    bias = None if bias is None else bias.contiguous()
    _gemv_smem_kernel[(triton.cdiv(n, rows),)](
        desc, x, bias if bias is not None else y, y, m, n, k, x.stride(0),
        HAS_BIAS=bias is not None, ROWS=rows, BLOCK_K=BLOCK_K, K_TILES=k // BLOCK_K, NUM_WARPS=NUM_WARPS,
        PDL=pdl, num_warps=NUM_WARPS, **({"launch_pdl": True} if pdl else {}))
    return y
