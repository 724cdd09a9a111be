"""Prefill-sized GEMM ``y = x @ dequantize(W)^T (+ bias)`` with FP8 weights (M > 16 rows): two ways, Triton.

- ``w8a16_gemm_triton``: a tiled matmul that reads the float8 W tile, converts it in registers to x's dtype (exact:
  e4m3 values are bf16 and fp16 values) and multiplies with ``tl.dot`` in fp32; each K tile's product is scaled by its
  columns' scales before it joins the accumulator, so a weight is read once, as one byte, and the scales apply in
  fp32 as the reference's do. BLOCK_K divides the scale block's width (``scale_tile_limit``).
- ``dequant_linear``: the weight dequantized to x's dtype by ``dequantize_fp8_triton`` (one pass writing a 16-bit
  copy), then cuBLAS through ``F.linear``; the copy is a temporary of the step.

At prefill sizes the GEMM is compute-bound, so either can win; ``kernels.dispatch.FP8_PREFILL`` names the one the
dispatcher takes (bench/fp8_kernels.py times both). The torch oracle is ``kernels.fp8.fp8_linear_ref``. Launch
parameters come from the shape alone (no autotune): CUDA-graph capturable, no host synchronisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import dequantize_fp8_ref, scale_tile_limit
from kernels.triton_compat import INTERPRET, tl, triton
from kernels.triton_compat import jit as _jit


@_jit(do_not_specialize=["M"])
def _w8a16_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K, x_s0, y_s0, s_s0, scale_rows, scale_cols,
    HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y. Programs run GROUP_M row tiles down a column of tiles before moving on, so
    the W tiles they share are read from L2."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)  # clamped: out-of-range rows and columns are never stored
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rows_m[:, None] * x_s0 + offs_k[None, :]
    w_ptrs = w_ptr + rows_n[:, None] * K + offs_k[None, :]
    s_ptrs = s_ptr + (rows_n // scale_rows) * s_s0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_mask = (k + offs_k < K)[None, :]
            a = tl.load(x_ptrs, mask=k_mask, other=0.0)
            b = tl.load(w_ptrs, mask=k_mask, other=0.0)
        s = tl.load(s_ptrs + k // scale_cols)
        if DOT_FP32:
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(a, tl.trans(b.to(a.dtype)))
        acc += part * s[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * y_s0 + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask)


def w8a16_config(m: int, n: int, k: int, block_cols: int, dtype: torch.dtype) -> dict[str, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M) by row count: [64, 128] tiles up to 64 rows, [128, 128]
    above; BLOCK_K 128 (the scale blocks' width) for 16-bit x, 32 for fp32 (its dot holds twice the bytes)."""
    k_cap = 32 if dtype == torch.float32 else 128
    block_k = max(16, min(k_cap, scale_tile_limit(block_cols, k), triton.next_power_of_2(k)))
    if m <= 64:
        block_m, warps, stages = 64, 4, 4
    else:
        block_m, warps, stages = 128, 8, 3
    block_n = 128 if n >= 128 else max(16, triton.next_power_of_2(n))
    return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": warps, "num_stages": stages,
            "group_m": 8}


def w8a16_gemm_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_linear_ref``'s values for x [M, K] (16-bit or fp32) and W float8 [N, K] with its scale grid. ``out``: a
    [M, N] destination with unit column stride (a column slice of a wider output is fine), returned."""
    (m, k), n = x.shape, weight.shape[0]
    if weight.dtype != torch.float8_e4m3fn or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"need a contiguous float8_e4m3fn [N, {k}] weight, got {weight.dtype} {tuple(weight.shape)}")
    if scale.dtype != torch.float32 or scale.stride(1) != 1:
        raise ValueError(f"scale must be row-major float32, got {scale.dtype}")
    block_k = scale_tile_limit(block[1], k)
    if block_k < 16:
        return dequant_linear(x, weight, scale, block, bias, out=out)
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if y.shape != (m, n) or y.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {n}] with unit column stride")
    if m == 0 or n == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = w8a16_config(m, n, k, block[1], x.dtype)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _w8a16_gemm_kernel[grid](
        x, weight, scale, bias if bias is not None else y, y, m, n, k, x.stride(0), y.stride(0), scale.stride(0),
        block[0], block[1], HAS_BIAS=bias is not None, DOT_FP32=INTERPRET or x.dtype == torch.float32,
        EVEN_K=k % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["group_m"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y


@_jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, N, K, s_s0, scale_rows, scale_cols,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n, k] = q[n, k] * scale[n // rows, k // cols] in fp32, rounded once to out's dtype."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    q = tl.load(q_ptr + rows * K + offs_k[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + (rows // scale_rows) * s_s0 + (offs_k // scale_cols)[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows * K + offs_k[None, :], (q.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_fp8_triton(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """``dequantize_fp8_ref(q, scale, block, dtype)`` of a 2-D weight in one pass (no [N, K] scale expansion)."""
    if q.dim() != 2 or not q.is_contiguous() or scale.stride(-1) != 1:
        return dequantize_fp8_ref(q, scale, block, dtype)
    n, k = q.shape
    out = torch.empty(n, k, dtype=dtype, device=q.device)
    if n and k:
        _dequantize_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 256))](
            q, scale, out, n, k, scale.stride(0), block[0], block[1], BLOCK_N=32, BLOCK_K=256, num_warps=4)
    return out


def dequant_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over the weight dequantized to x's dtype (``dequantize_fp8_triton`` on CUDA, the reference
    elsewhere); ``out`` as ``w8a16_gemm_triton``'s."""
    if x.is_cuda:
        w = dequantize_fp8_triton(weight, scale, block, x.dtype)
    else:
        w = dequantize_fp8_ref(weight, scale, block, x.dtype)
    y = F.linear(x, w, bias)
    if out is None:
        return y
    out.copy_(y)
    return out
