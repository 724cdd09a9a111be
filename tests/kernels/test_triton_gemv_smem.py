"""The shared-memory-resident GEMV (kernels/triton_gemv_smem.py, Gluon) and its dispatch from ``gemv_triton``.

Gluon kernels do not run under the interpreter: on CPU these tests check the schedule (``smem_rows``) and that the
dispatch never takes the kernel; the GPU tests (Hopper) run the model shapes against the torch reference and the
row loop bitwise against one-row calls.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import triton_gemv_smem
from kernels.triton_gemv import gemv_ref, gemv_triton
from kernels.triton_gemv_smem import BLOCK_K, SMEM_BYTES, gemv_smem, smem_for, smem_rows

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HOPPER = not INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="TMA and Gluon need capability >= 9 (not the interpreter)")
DEVICE = "cuda" if HOPPER else "cpu"


def randn(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Two ulps of the output's magnitude (the order of the sums differs from the fp32 reference)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.float().abs().max().item() + 1.0
    ulp = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(actual.float(), expected.float(), atol=2 * ulp * scale, rtol=2 * ulp)


def test_rows_fill_one_wave_within_the_shared_memory_budget():
    assert smem_rows(2048, 4096, torch.bfloat16, 132) == 16  # the MoE shapes' o_proj / out_proj: 128 programs
    assert smem_rows(2048, 4096, torch.bfloat16, 78) is None  # 32 rows of 8 KiB pass the budget
    assert smem_rows(5120, 2048, torch.bfloat16, 132) is None  # 64 rows of 4 KiB
    assert smem_rows(128, 2048, torch.bfloat16, 132) == 1
    assert smem_rows(128, 2000, torch.bfloat16, 132) is None  # K not a multiple of the TMA box
    for n, k, sms in [(2048, 4096, 132), (100, 1024, 7), (1, 256, 1)]:
        rows = smem_rows(n, k, torch.bfloat16, sms)
        assert k % BLOCK_K == 0 and rows * 2 * k <= SMEM_BYTES and -(-n // rows) <= sms


def test_not_dispatched_without_a_hopper_gpu_and_dependent_launch():
    x, w = randn(1, 256), randn(64, 256, seed=1)
    assert not smem_for(x.cpu(), w.cpu(), 132, row_loop=False, pdl=True)
    if HOPPER:
        assert not smem_for(x, w, 132, row_loop=False, pdl=False)
        assert not smem_for(torch.cat([x, x]), w, 132, row_loop=False, pdl=True)
        assert smem_for(torch.cat([x, x]), w, 132, row_loop=True, pdl=True)


def test_errors():
    with pytest.raises(ValueError, match="not for the shared-memory GEMV"):
        gemv_smem(randn(1, 4096), randn(2048, 4096, seed=1), num_sms=8)
    with pytest.raises(ValueError, match="not for the shared-memory GEMV"):
        gemv_smem(randn(17, 256), randn(64, 256, seed=1), num_sms=132)


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("n, k, bias", [(2048, 4096, False), (128, 2048, True), (1000, 3072, True), (7, 256, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_reference_and_dispatch(n, k, bias, dtype):
    x = randn(1, k, dtype=dtype)
    w = randn(n, k, dtype=dtype, seed=1, scale=k**-0.5)
    b = randn(n, dtype=dtype, seed=2) if bias else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert smem_for(x, w, sms, row_loop=False, pdl=True)
    close(gemv_smem(x, w, b, num_sms=sms), gemv_ref(x, w, b))
    close(gemv_smem(x, w, b, num_sms=sms, pdl=False), gemv_ref(x, w, b))
    close(gemv_triton(x, w, b), gemv_ref(x, w, b))


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 5, 16])
def test_gpu_row_loop_bitwise(m):
    n, k = 2048, 4096
    x = randn(m, k, seed=8)
    w = randn(n, k, seed=9, scale=k**-0.5)
    rows = gemv_triton(x, w, row_loop=True)
    assert triton_gemv_smem.smem_for(x, w, torch.cuda.get_device_properties(0).multi_processor_count, True, True)
    close(rows, gemv_ref(x, w))
    for i in range(m):
        assert torch.equal(rows[i:i + 1], gemv_triton(x[i:i + 1], w))
