"""Prefill-sized GEMM ``y = x @ dequantize(W)^T (+ bias)`` with FP8 weights (M > 16 rows).

``dequant_linear``: the weight dequantized to x's dtype by ``dequantize_fp8_triton`` (one pass writing a 16-bit
copy, a temporary of the step), then cuBLAS through ``F.linear``. At prefill sizes the GEMM is compute-bound, and
cuBLAS on the copy beat a Triton W8A16 GEMM converting tiles in registers (bench/fp8_kernels.py,
bench/results/fp8-kernels-h200-*.json). The torch oracle is ``kernels.fp8.fp8_linear_ref``. No autotune, no host
synchronisation: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import dequantize_fp8_ref
from kernels.triton_compat import tl, triton
from kernels.triton_compat import jit as _jit


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
    elsewhere); ``out``: a [M, N] view the result is written into."""
    if x.is_cuda:
        w = dequantize_fp8_triton(weight, scale, block, x.dtype)
    else:
        w = dequantize_fp8_ref(weight, scale, block, x.dtype)
    y = F.linear(x, w, bias)
    if out is None:
        return y
    out.copy_(y)
    return out
