"""The persistent TMA GEMV (kernels/triton_gemv_tma.py) and its dispatch from kernels/triton_gemv.py.

On CPU (conftest sets TRITON_INTERPRET=1) ``tma_supported`` is False and the dispatch keeps the plain kernel; the
interpreter still runs the TMA kernel itself (descriptor loads emulated) on tiny shapes with a few programs, which
checks its persistent schedule, ragged tiles and the fused norm, though not dependent launch (inline PTX) nor the
compiled pipeline. The GPU tests (Hopper or later) compare against the torch references at the model shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import triton_gemv, triton_gemv_tma
from kernels.triton_gemv import gemv_norm_ref, gemv_norm_triton, gemv_ref, gemv_triton
from kernels.triton_gemv_tma import gemv_norm_tma, gemv_tma, tma_config, tma_supported

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HOPPER = (not INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="TMA needs a CUDA device of capability >= 9 (not the interpreter)")
DEVICE = "cuda" if HOPPER else "cpu"
# the plain kernel's operands that the TMA kernel never takes: the interpreter's (CPU) or fp32 on a GPU
PLAIN_DEVICE, PLAIN_DTYPE = ("cpu", torch.bfloat16) if INTERPRET else ("cuda", torch.float32)


def randn(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, scale: float = 1.0,
          device: str = DEVICE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Two ulps of the output's magnitude (as tests/kernels/test_triton_gemv.py: the interpreter truncates its
    casts, and tile order changes the sums)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.float().abs().max().item() + 1.0
    ulp = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(actual.float(), expected.float(), atol=2 * ulp * scale, rtol=2 * ulp)


def operands(n: int, k: int, seed: int = 0, device: str = DEVICE, dtype: torch.dtype = torch.bfloat16):
    """x [1, K], W [N, K], bias, residual, norm weight."""
    return (randn(1, k, seed=seed, device=device, dtype=dtype),
            randn(n, k, seed=seed + 1, scale=k**-0.5, device=device, dtype=dtype),
            randn(n, seed=seed + 2, device=device, dtype=dtype), randn(1, k, seed=seed + 3, device=device, dtype=dtype),
            (1 + 0.3 * randn(k, seed=seed + 4, device=device, dtype=torch.float32)).to(dtype))


def test_tma_not_supported_on_cpu_or_for_other_operands():
    x, w, *_ = operands(64, 256, device="cpu")
    assert not tma_supported(x, w)
    assert not tma_supported(x.float(), w.float())
    assert not tma_supported(torch.cat([x, x]), w)


def test_config_is_deterministic_and_valid():
    for n, k in [(128, 2048), (264, 2048), (2048, 4096), (5120, 2048), (12352, 2048), (151936, 2048), (7, 8)]:
        for dtype, norm in [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)]:
            cfg = tma_config(n, k, dtype, norm=norm)
            assert cfg == tma_config(n, k, dtype, norm=norm)
            assert all(cfg[key] & (cfg[key] - 1) == 0 for key in ("block_n", "block_k"))
            assert cfg["block_k"] * dtype.itemsize >= 16 and cfg["block_n"] >= 4
            smem = cfg["stages"] * cfg["block_n"] * cfg["block_k"] * dtype.itemsize
            assert smem <= triton_gemv_tma.SMEM_BYTES_PER_PROGRAM
            assert cfg["programs_per_sm"] >= 1 and cfg["stages"] >= 2
    assert tma_config(151936, 2048, torch.bfloat16, norm=True)["block_n"] == 32
    assert tma_config(264, 2048, torch.bfloat16, norm=True)["block_n"] == 4  # fewer row blocks than SMs: shorter


def test_errors():
    x, w, bias, *_ = operands(64, 256, device="cpu")
    with pytest.raises(ValueError, match="one 16-bit row"):
        gemv_tma(torch.cat([x, x]), w)
    with pytest.raises(ValueError, match="one 16-bit row"):
        gemv_tma(x.float(), w.float())
    with pytest.raises(ValueError, match="powers of two"):
        gemv_tma(x, w, block_n=3)
    with pytest.raises(ValueError, match="16 bytes"):
        gemv_tma(x, w, block_k=4)
    with pytest.raises(ValueError, match="exceed"):
        gemv_tma(x, w, block_n=64, block_k=256, stages=8)
    with pytest.raises(ValueError, match="norm weight"):
        gemv_norm_tma(x, None, bias, 1e-6, w)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter run of the kernel (the GPU tests cover the compiled one)")
@pytest.mark.parametrize("n,k,block_n,block_k", [(70, 200, 8, 64), (64, 256, 4, 256), (33, 48, 16, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_interpreted_kernel_persistent_schedule(monkeypatch, n, k, block_n, block_k, bias):
    """Two 'SMs' of one program each: every program walks several row blocks (a ragged last one, a ragged last K
    tile for K = 200 and 48, a single K tile for K = 256 with 256-wide tiles)."""
    monkeypatch.setattr(triton_gemv_tma, "_sms", lambda x: 2)
    x, w, b, r, nw = operands(n, k)
    b = b if bias else None
    kw = {"block_n": block_n, "block_k": block_k, "programs_per_sm": 1, "pdl": False}
    close(gemv_tma(x, w, b, **kw), gemv_ref(x, w, b))
    for res in (None, r):
        out = gemv_norm_tma(x, res, nw, 1e-6, w, b, True, **kw)
        ref = gemv_norm_ref(x, res, nw, 1e-6, w, b, True)
        close(out.y, ref.y)
        close(out.normed, ref.normed)
        close(out.residual, ref.residual)
        assert out.residual is x if res is None else out.residual.data_ptr() not in (x.data_ptr(), r.data_ptr())


@pytest.mark.skipif(not INTERPRET, reason="the interpreter run of the kernel (the GPU tests cover the compiled one)")
@pytest.mark.parametrize("rows", [1, 3])
def test_interpreted_float32_output_is_the_rounded_output(monkeypatch, rows):
    """``out_dtype=float32`` (logits) stores the values the 16-bit output holds, one row and a row loop."""
    monkeypatch.setattr(triton_gemv_tma, "_sms", lambda x: 2)
    x, w, b, _, _ = operands(70, 200)
    x = torch.cat([x] + [randn(1, 200, seed=9 + i) for i in range(rows - 1)])
    kw = {"block_n": 8, "block_k": 64, "programs_per_sm": 1, "pdl": False, "row_loop": rows > 1}
    wide = gemv_tma(x, w, b, out_dtype=torch.float32, **kw)
    assert wide.dtype == torch.float32 and torch.equal(wide, gemv_tma(x, w, b, **kw).float())


def test_dispatch_falls_back_where_tma_is_not_supported():
    """Operands the TMA kernel does not take (CPU, or fp32): the plain kernel runs, with the results of the
    references."""
    x, w, bias, r, nw = operands(70, 200, device=PLAIN_DEVICE, dtype=PLAIN_DTYPE)
    assert not tma_supported(x, w)
    close(gemv_triton(x, w, bias), gemv_ref(x, w, bias))
    out = gemv_norm_triton(x, r, nw, 1e-6, w, None, True)
    ref = gemv_norm_ref(x, r, nw, 1e-6, w, None, True)
    close(out.y, ref.y)
    close(out.normed, ref.normed)


def test_dispatch_routes_only_unoverridden_supported_calls(monkeypatch):
    calls: list[str] = []

    def fake_gemv(x, w, b=None, *, pdl=None, row_loop=False, out_dtype=None):
        calls.append(f"gemv pdl={pdl}")
        return gemv_ref(x, w, b).to(out_dtype or x.dtype)

    def fake_norm(x, res, nw, eps, w, b=None, write_normed=False, *, pdl=None, row_loop=False):
        calls.append(f"norm pdl={pdl}")
        return gemv_norm_ref(x, res, nw, eps, w, b, write_normed)

    monkeypatch.setattr(triton_gemv_tma, "tma_supported", lambda x, w: True)
    monkeypatch.setattr(triton_gemv, "GEMV_TMA_MIN_BYTES", 0)
    monkeypatch.setattr(triton_gemv_tma, "gemv_tma", fake_gemv)
    monkeypatch.setattr(triton_gemv_tma, "gemv_norm_tma", fake_norm)
    x, w, bias, r, nw = operands(70, 200, device=PLAIN_DEVICE, dtype=PLAIN_DTYPE)
    close(gemv_triton(x, w, bias), gemv_ref(x, w, bias))
    close(gemv_norm_triton(x, r, nw, 1e-6, w).y, gemv_norm_ref(x, r, nw, 1e-6, w).y)
    pdl = bool(triton_gemv.pdl_launch(x))  # the dispatch passes the plain kernel's launch choice on
    assert calls == [f"gemv pdl={pdl}", f"norm pdl={pdl}"]
    gemv_triton(x, w, bias, block_n=2)  # any override keeps the plain kernel
    gemv_norm_triton(x, r, nw, 1e-6, w, block_k=64)
    assert len(calls) == 2
    monkeypatch.setattr(triton_gemv, "GEMV_TMA_MIN_BYTES", w.numel() * w.element_size() + 1)  # W below the floor
    gemv_triton(x, w, bias)
    gemv_norm_triton(x, r, nw, 1e-6, w)
    assert len(calls) == 2


SHAPES_N = [128, 264, 2048, 5120, 12352, 151936]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("k", [2048, 4096])
@pytest.mark.parametrize("n", SHAPES_N)
def test_gpu_gemv_tma(n, k):
    x, w, bias, *_ = operands(n, k)
    assert tma_supported(x, w)
    for b in (None, bias):
        expected = gemv_ref(x, w, b)
        for pdl in (False, True):
            close(gemv_tma(x, w, b, pdl=pdl), expected)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("k", [2048, 4096])
@pytest.mark.parametrize("n", SHAPES_N)
def test_gpu_gemv_norm_tma(n, k):
    x, w, bias, r, nw = operands(n, k)
    for res, b, write_normed, pdl in [(None, None, False, False), (r, None, True, True), (r, bias, False, True),
                                      (None, bias, True, True), (r, None, True, False)]:
        out = gemv_norm_tma(x, res, nw, 1e-6, w, b, write_normed, pdl=pdl)
        ref = gemv_norm_ref(x, res, nw, 1e-6, w, b, write_normed)
        close(out.y, ref.y)
        if res is None:
            assert out.residual is x
        else:
            assert torch.equal(out.residual, ref.residual)  # one rounding of x + r, as torch's add
        if write_normed:
            close(out.normed, ref.normed)
        else:
            assert out.normed is None


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("tile", [(8, 1024, 3, 4, False), (32, 256, 3, 4, True), (16, 512, 3, 64, False),
                                  (32, 256, 4, 2, False), (16, 256, 4, 4, True), (4, 512, 6, 8, False)])
def test_gpu_tma_overrides(tile):
    """Launch settings around ``tma_config``'s (the next kernel launched late too), on a ragged N and an fp16
    weight."""
    block_n, block_k, stages, pps, late = tile
    kw = {"block_n": block_n, "block_k": block_k, "stages": stages, "programs_per_sm": pps, "late_trigger": late}
    for dtype in (torch.bfloat16, torch.float16):
        x, w, bias, r, nw = operands(5000, 2048, dtype=dtype)
        close(gemv_tma(x, w, bias, **kw), gemv_ref(x, w, bias))
        out = gemv_norm_tma(x, r, nw, 1e-6, w, None, True, **kw)
        ref = gemv_norm_ref(x, r, nw, 1e-6, w, None, True)
        close(out.y, ref.y)
        close(out.normed, ref.normed)


@pytest.mark.gpu
@needs_hopper
def test_gpu_tma_in_a_cuda_graph_and_dispatch(monkeypatch):
    """Captured once, replayed with new inputs (the descriptor's base is the weight, x is read at replay), and
    ``gemv_triton`` / ``gemv_norm_triton``, dispatching to it, give the same results."""
    x, w, bias, r, nw = operands(5120, 2048)
    x_in = x.clone()
    gemv_tma(x_in, w, bias)  # compile outside the capture
    gemv_norm_tma(x_in, r, nw, 1e-6, w, None, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv_tma(x_in, w, bias)
        normed = gemv_norm_tma(x_in, r, nw, 1e-6, w, None, True)
    for seed in (10, 11):
        x_in.copy_(randn(1, 2048, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        close(y, gemv_ref(x_in, w, bias))
        ref = gemv_norm_ref(x_in, r, nw, 1e-6, w, None, True)
        close(normed.y, ref.y)
        close(normed.normed, ref.normed)
        assert torch.equal(normed.residual, ref.residual)
    monkeypatch.setattr(triton_gemv, "GEMV_TMA_MIN_BYTES", 0)
    close(gemv_triton(x, w, bias), gemv_ref(x, w, bias))
    out = gemv_norm_triton(x, r, nw, 1e-6, w, None, True)
    close(out.y, gemv_norm_ref(x, r, nw, 1e-6, w, None, True).y)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter run of the kernel (the GPU tests cover the compiled one)")
@pytest.mark.parametrize("n,k,block_n,block_k", [(70, 200, 8, 64), (64, 256, 4, 256)])
def test_interpreted_rows_kernel_gives_each_row_its_one_row_bits(monkeypatch, n, k, block_n, block_k):
    """``row_loop``: every row of a several-row call equals its own one-row call, bit for bit (a ragged row block,
    one K tile and several), with the norm's residual and normed rows."""
    monkeypatch.setattr(triton_gemv_tma, "_sms", lambda x: 2)
    kw = {"block_n": block_n, "block_k": block_k, "programs_per_sm": 1, "pdl": False}
    _, w, b, _, nw = operands(n, k)
    x, r = randn(3, k, seed=11), randn(3, k, seed=12)
    out = gemv_tma(x, w, b, row_loop=True, **kw)
    assert torch.equal(out, torch.cat([gemv_tma(x[i:i + 1], w, b, **kw) for i in range(3)]))
    close(out, gemv_ref(x, w, b))
    for res in (None, r):
        rows = gemv_norm_tma(x, res, nw, 1e-6, w, b, True, row_loop=True, **kw)
        singles = [gemv_norm_tma(x[i:i + 1], None if res is None else res[i:i + 1], nw, 1e-6, w, b, True, **kw)
                   for i in range(3)]
        for field in ("y", "residual", "normed"):
            assert torch.equal(getattr(rows, field), torch.cat([getattr(s, field) for s in singles])), field
