"""The register-resident GEMV (kernels/triton_gemv_resident.py) and its dispatch from ``gemv_triton``.

On CPU (conftest sets TRITON_INTERPRET=1) the dispatch never takes it (no dependent launch there); the interpreter
runs the kernel itself on small shapes with a small SM count, which checks its one-wave schedule, clamped rows,
ragged K, the bias and the row loop, though not the early loads nor the opaque move (inline PTX). The GPU tests
(Hopper) run the model shapes and check the row loop bitwise against one-row calls.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import triton_gemv_resident
from kernels.triton_gemv import gemv_ref, gemv_triton
from kernels.triton_gemv_resident import RESIDENT_BYTES, gemv_resident, resident_for, resident_rows

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HOPPER = not INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="dependent launch needs capability >= 9 (not the interpreter)")
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


def test_rows_fill_one_wave_within_the_register_budget():
    assert resident_rows(2048, 4096, torch.bfloat16, 132) == 16  # the MoE shapes' o_proj / out_proj: 128 programs
    assert resident_rows(2048, 4096, torch.bfloat16, 78) is None  # 32 rows of 8 KiB pass the budget
    assert resident_rows(5120, 2048, torch.bfloat16, 132) is None  # 64 rows of 4 KiB
    assert resident_rows(128, 2048, torch.bfloat16, 132) == 1
    assert resident_rows(24, 100, torch.bfloat16, 4) == 8  # K padded to 128
    for n, k, sms in [(2048, 4096, 132), (100, 1000, 7), (1, 8, 1)]:
        rows = resident_rows(n, k, torch.bfloat16, sms)
        assert rows * 2 * (1 << (k - 1).bit_length()) <= RESIDENT_BYTES and -(-n // rows) <= sms


def test_not_dispatched_without_dependent_launch():
    x, w = randn(1, 256), randn(64, 256, seed=1)
    assert not resident_for(x.cpu(), w.cpu(), 132, row_loop=False)
    if not HOPPER:
        assert not resident_for(x, w, 132, row_loop=False)


@pytest.mark.parametrize("n, k, sms, bias", [(24, 100, 4, True), (64, 256, 8, False), (37, 64, 5, True),
                                             (5, 512, 132, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(n, k, sms, bias, dtype):
    x = randn(1, k, dtype=dtype)
    w = randn(n, k, dtype=dtype, seed=1, scale=k**-0.5)
    b = randn(n, dtype=dtype, seed=2) if bias else None
    close(gemv_resident(x, w, b, num_sms=sms, pdl=False), gemv_ref(x, w, b))


@pytest.mark.parametrize("m", [2, 5, 16])
def test_row_loop_rows_equal_their_one_row_calls(m):
    n, k, sms = 40, 192, 6
    x = randn(m, k, seed=3)
    w = randn(n, k, seed=4, scale=k**-0.5)
    b = randn(n, seed=5)
    rows = gemv_resident(x, w, b, num_sms=sms, pdl=False)
    close(rows, gemv_ref(x, w, b))
    for i in range(m):
        assert torch.equal(rows[i:i + 1], gemv_resident(x[i:i + 1], w, b, num_sms=sms, pdl=False))


def test_strided_rows():
    k = 128
    x = randn(3, 2 * k, seed=6)[:, :k]  # row stride 2k
    w = randn(32, k, seed=7, scale=k**-0.5)
    close(gemv_resident(x, w, num_sms=4, pdl=False), gemv_ref(x, w))


def test_errors():
    x, w = randn(1, 256), randn(64, 256, seed=1)
    with pytest.raises(ValueError, match="16-bit"):
        gemv_resident(x.float(), w.float())
    with pytest.raises(ValueError, match=r"x \[1..16, K\]"):
        gemv_resident(randn(17, 256), w)
    with pytest.raises(ValueError, match="does not fit"):
        gemv_resident(randn(1, 4096), randn(2048, 4096, seed=1), num_sms=8)


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(2048, 4096), (128, 2048), (1000, 3000)])
def test_gpu_model_shapes_and_dispatch(n, k):
    x = randn(1, k)
    w = randn(n, k, seed=1, scale=k**-0.5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert resident_for(x, w, sms, row_loop=False) == (resident_rows(n, k, x.dtype, sms) is not None)
    close(gemv_triton(x, w), gemv_ref(x, w))
    close(gemv_resident(x, w, num_sms=sms), gemv_ref(x, w))


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 5, 16])
def test_gpu_row_loop_bitwise(m):
    n, k = 2048, 4096
    x = randn(m, k, seed=8)
    w = randn(n, k, seed=9, scale=k**-0.5)
    rows = gemv_triton(x, w, row_loop=True)
    assert triton_gemv_resident.resident_for(x, w, torch.cuda.get_device_properties(0).multi_processor_count, True)
    for i in range(m):
        assert torch.equal(rows[i:i + 1], gemv_triton(x[i:i + 1], w))
