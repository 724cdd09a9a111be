"""The shared-tile TMA GEMV (kernels/triton_gemv_tma_rows.py).

On CPU (conftest sets TRITON_INTERPRET=1) the interpreter runs the kernel on small shapes (descriptor loads
emulated): the persistent schedule, ragged tiles, the fused norm and that a row's bits do not depend
on the rows beside it. The GPU tests (Hopper) run the model shapes, bitwise across row counts.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.triton_gemv import gemv_norm_ref, gemv_ref
from kernels.triton_gemv_tma_rows import gemv_norm_tma_rows, gemv_tma_rows, rows_supported

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HOPPER = not INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
DEVICE = "cuda" if HOPPER else "cpu"
SMALL = {} if HOPPER else {"programs_per_sm": 1, "block_k": 128, "block_n": 8}  # the interpreter: few programs, short tiles


def randn(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Two ulps of the output's magnitude (the interpreter truncates its casts; the tiles order the sums)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.float().abs().max().item() + 1.0
    ulp = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(actual.float(), expected.float(), atol=2 * ulp * scale, rtol=2 * ulp)


def test_not_supported_on_cpu_or_past_sixteen_rows():
    x, w = randn(2, 256).cpu(), randn(64, 256, seed=1).cpu()
    assert not rows_supported(x, w)
    with pytest.raises(ValueError, match="1..16 contiguous 16-bit rows"):
        gemv_tma_rows(randn(17, 256), randn(64, 256, seed=1))
    with pytest.raises(ValueError, match="1..16 contiguous 16-bit rows"):
        gemv_tma_rows(randn(2, 256).float(), randn(64, 256, seed=1).float())


@pytest.mark.parametrize("m,n,k", [(1, 40, 256), (5, 17, 512), (16, 33, 128), (3, 70, 384)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference_and_rows_are_independent(m, n, k, bias):
    x, w = randn(m, k, seed=2), randn(n, k, seed=3, scale=k**-0.5)
    b = randn(n, seed=4) if bias else None
    y = gemv_tma_rows(x, w, b, **SMALL)
    close(y, gemv_ref(x, w, b))
    for i in range(m):
        assert torch.equal(y[i:i + 1], gemv_tma_rows(x[i:i + 1], w, b, **SMALL))


@pytest.mark.parametrize("residual,write_normed", [(True, True), (False, False), (True, False)])
def test_norm_matches_reference_and_rows_are_independent(residual, write_normed):
    m, n, k = 4, 40, 256
    x, w = randn(m, k, seed=5), randn(n, k, seed=6, scale=k**-0.5)
    r = randn(m, k, seed=7) if residual else None
    nw = (1 + 0.3 * randn(k, seed=8)).to(torch.bfloat16)
    out = gemv_norm_tma_rows(x, r, nw, 1e-6, w, None, write_normed, **SMALL)
    ref = gemv_norm_ref(x, r, nw, 1e-6, w, None, write_normed)
    close(out.y, ref.y)
    close(out.residual, ref.residual)
    if write_normed:
        close(out.normed, ref.normed)
    for i in range(m):
        one = gemv_norm_tma_rows(x[i:i + 1], None if r is None else r[i:i + 1], nw, 1e-6, w, None, write_normed,
                                **SMALL)
        assert torch.equal(out.y[i:i + 1], one.y)
        assert torch.equal(out.residual[i:i + 1], one.residual)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="TMA needs a CUDA device of capability >= 9")
@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (151936, 4096), (12352, 2048)])
def test_gpu_model_shapes_rows_bitwise(m, n, k):
    x, w = randn(m, k, seed=9), randn(n, k, seed=10, scale=k**-0.5)
    r, nw = randn(m, k, seed=11), (1 + 0.3 * randn(k, seed=12)).to(torch.bfloat16)
    assert rows_supported(x, w)
    y = gemv_tma_rows(x, w)
    close(y, gemv_ref(x, w))
    out = gemv_norm_tma_rows(x, r, nw, 1e-6, w, None, True)
    ref = gemv_norm_ref(x, r, nw, 1e-6, w, None, True)
    close(out.y, ref.y)
    close(out.normed, ref.normed)
    for i in range(m):
        assert torch.equal(y[i:i + 1], gemv_tma_rows(x[i:i + 1], w))
        one = gemv_norm_tma_rows(x[i:i + 1], r[i:i + 1], nw, 1e-6, w, None, True)
        assert torch.equal(out.y[i:i + 1], one.y) and torch.equal(out.normed[i:i + 1], one.normed)
