"""The prefill-sized FP8 projections (kernels/triton_fp8_gemm.py) against the torch reference: dequantize-then-F.linear
with partial edge blocks, bf16 and fp32 activations and bias; the one-pass dequantization; and
``dispatch.fp8_linear``'s routing.

On CPU the kernels run under the Triton interpreter on tiny shapes (its bf16 casts truncate: two ulps of the output
there); the gpu tests run projection shapes at M = 512 and 2048.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import dispatch
from kernels.fp8 import dequantize_fp8_ref, fp8_linear_ref, quantize_fp8_block_ref
from kernels.triton_fp8_gemm import dequant_linear, dequantize_fp8_triton
from tests.kernels.fp8_checks import DEVICE, close, randn



def fp8_weight(n: int, k: int, kind: str = "block", seed: int = 1, device: str = DEVICE):
    block = {"block": (128, 128), "channel": (1, k), "tensor": (n, k)}[kind]
    q, scale = quantize_fp8_block_ref(randn(n, k, seed=seed, scale=k ** -0.5, device=device), block)
    return q, scale, block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_then_linear(dtype):
    q, scale, block = fp8_weight(150, 200)
    exact = dequantize_fp8_triton(q, scale, block, torch.float32)
    assert torch.equal(exact, dequantize_fp8_ref(q, scale, block))  # fp32: the exact values
    close(dequantize_fp8_triton(q, scale, block, dtype), dequantize_fp8_ref(q, scale, block, dtype), ulps=1)
    x, b = randn(20, 200, dtype=dtype, seed=4), randn(150, dtype=dtype, seed=5)
    close(dequant_linear(x, q, scale, block, b), fp8_linear_ref(x, q, scale, block, b), ulps=4)


def test_fp8_linear_routes_by_rows_and_device():
    """Without CUDA ``fp8_linear`` is the torch reference, tail rows included."""
    q, scale, block = fp8_weight(150, 200, device="cpu")
    x, tail = randn(20, 200, device="cpu"), randn(6, 200, seed=7, device="cpu")
    b = randn(156, seed=8, device="cpu")
    want = F.linear(x, torch.cat([dequantize_fp8_ref(q, scale, block), tail]), b)
    torch.testing.assert_close(dispatch.fp8_linear(x, q, scale, block, b, tail), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 512, 2048])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 12288)])
def test_gpu_fp8_prefill_projections(m, n, k):
    q, scale, block = fp8_weight(n, k, device="cuda")
    x = randn(m, k, dtype=torch.bfloat16, seed=2, device="cuda")
    expected = fp8_linear_ref(x, q, scale, block)
    close(dequant_linear(x, q, scale, block), expected, ulps=8)  # its weights rounded to bf16 first
    assert torch.equal(dequantize_fp8_triton(q, scale, block, torch.bfloat16),
                       dequantize_fp8_ref(q, scale, block, torch.bfloat16))
    tail = randn(64, k, dtype=torch.bfloat16, seed=3, scale=k ** -0.5, device="cuda")
    y = dispatch.fp8_linear(x, q, scale, block, None, tail)
    close(y[:, :n], expected, ulps=8)
    close(y[:, n:], F.linear(x, tail), ulps=2)
