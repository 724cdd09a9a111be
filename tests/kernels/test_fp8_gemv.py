"""The FP8 decode GEMV (kernels/triton_fp8_gemv.py) against its torch reference: block, channel and tensor scales
(partial edge blocks: N and K not multiples of 128, K not a multiple of BLOCK_K), bf16 and fp32 activations, M = 1,
3 and 16, split-K, bias, a 16-bit tail of rows, the fused residual-add RMSNorm, float32 logits, and the row loop giving
each row a one-row call's bits.

On CPU the kernel runs under the Triton interpreter on tiny shapes, where bf16 casts truncate instead of rounding:
bf16 is compared within two ulps of the output (the interpreter runs the dot path in fp32). The gpu tests run the
real shapes, the tensor-core path and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import quantize_fp8_block_ref
from kernels.triton_fp8_gemv import (GROUPED, _checked_mode, fp8_gemv_config, fp8_gemv_norm_ref,
                                     fp8_gemv_norm_triton, fp8_gemv_ref, fp8_gemv_triton)
from kernels.triton_gemv import SKINNY_MAX_M
from tests.kernels.fp8_checks import DEVICE, close, randn


def block_of(kind: str, n: int, k: int) -> tuple[int, int]:
    return {"block": (128, 128), "channel": (1, k), "tensor": (n, k)}[kind]


def fp8_weight(n: int, k: int, kind: str = "block", seed: int = 1, device: str = DEVICE):
    block = block_of(kind, n, k)
    q, scale = quantize_fp8_block_ref(randn(n, k, seed=seed, scale=k ** -0.5, device=device), block)
    return q, scale, block


@pytest.mark.parametrize("dtype,m,kind", [
    (torch.float32, 1, "block"), (torch.float32, 3, "tensor"), (torch.float32, 16, "channel"),
    (torch.bfloat16, 1, "tensor"), (torch.bfloat16, 3, "block"), (torch.bfloat16, 3, "channel"),
    (torch.bfloat16, 16, "block")])
def test_fp8_gemv_default_heuristic(dtype, m, kind):
    n, k = 130, 160  # partial blocks both ways; K not a multiple of BLOCK_K
    q, scale, block = fp8_weight(n, k, kind)
    x = randn(m, k, dtype=dtype, seed=2)
    bias = randn(n, dtype=dtype, seed=3) if m == 3 else None
    close(fp8_gemv_triton(x, q, scale, block, bias), fp8_gemv_ref(x, q, scale, block, bias))


@pytest.mark.parametrize("dtype,use_dot,m,split_k,k_sub,prefetch", [
    (torch.float32, False, 1, 3, 2, True), (torch.bfloat16, True, 5, 2, 3, False),
    (torch.bfloat16, True, 16, 1, 1, True), (torch.float32, True, 2, 1, 4, True)])
def test_fp8_gemv_paths_split_k_and_tail(dtype, use_dot, m, split_k, k_sub, prefetch):
    """Forced split-K (a ragged last split), several K tiles a loop step (a ragged last step), both multiply paths,
    the early first tile, and 16-bit tail rows after the FP8 rows (their own program tiles, y's last columns), bias
    over both."""
    n, k, tail_rows = 70, 300, 6
    q, scale, block = fp8_weight(n, k)
    x = randn(m, k, dtype=dtype, seed=4)
    tail = randn(tail_rows, k, dtype=dtype, seed=5, scale=k ** -0.5)
    bias = randn(n + tail_rows, dtype=dtype, seed=6)
    out = fp8_gemv_triton(x, q, scale, block, bias, tail=tail, block_n=16, block_k=32, k_sub=k_sub,
                          split_k=split_k, use_dot=use_dot, prefetch=prefetch)
    close(out, fp8_gemv_ref(x, q, scale, block, bias, tail))


@pytest.mark.parametrize("split_k", [None, 3])
def test_fp8_gemv_float32_logits_are_the_rounded_output(split_k):
    q, scale, block = fp8_weight(70, 200, "channel")
    x = randn(2, 200, dtype=torch.bfloat16, seed=7)
    kw = {} if split_k is None else {"split_k": split_k, "block_k": 32}
    wide = fp8_gemv_triton(x, q, scale, block, out_dtype=torch.float32, **kw)
    assert wide.dtype == torch.float32 and torch.equal(wide, fp8_gemv_triton(x, q, scale, block, **kw).float())


@pytest.mark.parametrize("dtype,m,residual,tail_rows", [
    (torch.float32, 1, False, 0), (torch.bfloat16, 1, True, 5), (torch.float32, 2, True, 0),
    (torch.bfloat16, 3, False, 3)])
def test_fp8_gemv_norm(dtype, m, residual, tail_rows):
    n, k = 130, 160
    q, scale, block = fp8_weight(n, k)
    x = randn(m, k, dtype=dtype, seed=8)
    r = randn(m, k, dtype=dtype, seed=9) if residual else None
    nw = (1 + 0.3 * randn(k, seed=10)).to(dtype)
    tail = randn(tail_rows, k, dtype=dtype, seed=11, scale=k ** -0.5) if tail_rows else None
    out = fp8_gemv_norm_triton(x, r, nw, 1e-6, q, scale, block, None, True, tail=tail)
    ref = fp8_gemv_norm_ref(x, r, nw, 1e-6, q, scale, block, None, True, tail)
    close(out.y, ref.y)
    close(out.normed, ref.normed)
    close(out.residual, ref.residual)
    assert fp8_gemv_norm_triton(x, r, nw, 1e-6, q, scale, block).normed is None


@pytest.mark.parametrize("dtype,m", [(torch.float32, 3), (torch.bfloat16, 5)])
def test_fp8_row_loop_equals_one_row_calls(dtype, m):
    """``row_loop``: each row's bits are a one-row call's (verify rows computed as decode rows), with and without the
    norm, a tail and bias included."""
    n, k = 40, 130
    q, scale, block = fp8_weight(n, k)
    x = randn(m, k, dtype=dtype, seed=12)
    tail = randn(3, k, dtype=dtype, seed=13, scale=k ** -0.5)
    bias = randn(n + 3, dtype=dtype, seed=14)
    out = fp8_gemv_triton(x, q, scale, block, bias, tail=tail, row_loop=True)
    assert torch.equal(out, torch.cat([fp8_gemv_triton(x[i:i + 1], q, scale, block, bias, tail=tail)
                                       for i in range(m)]))
    close(out, fp8_gemv_ref(x, q, scale, block, bias, tail))
    r, nw = randn(m, k, dtype=dtype, seed=15), (1 + 0.3 * randn(k, seed=16)).to(dtype)
    normed = fp8_gemv_norm_triton(x, r, nw, 1e-6, q, scale, block, bias, True, tail=tail, row_loop=True)
    singles = [fp8_gemv_norm_triton(x[i:i + 1], r[i:i + 1], nw, 1e-6, q, scale, block, bias, True, tail=tail)
               for i in range(m)]
    for field in ("y", "residual", "normed"):
        assert torch.equal(getattr(normed, field), torch.cat([getattr(s, field) for s in singles])), field


def test_fp8_gemv_config_tiles_fit_their_scales():
    """Every heuristic launch is valid: a TILE_SCALES tile within one scale column, a GROUPED tile (one row of x)
    whose rows share a scale row and whose width is whole scale columns, any width under one scale column."""
    for m in range(1, SKINNY_MAX_M + 1):
        for n, k in [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (5, 3), (130, 160)]:
            for block in ((128, 128), (1, 128), (1, k), (n, k)):
                for dtype, norm in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)):
                    cfg = fp8_gemv_config(m, n, k, block, dtype, norm=norm)
                    assert cfg == fp8_gemv_config(m, n, k, block, dtype, norm=norm)
                    mode = _checked_mode(m, cfg["block_n"], cfg["block_k"], cfg["k_sub"], cfg["use_dot"], block, k)
                    if m == 1 and block[1] < k:
                        assert mode == GROUPED
                    assert cfg["k_sub"] >= 1 and (k < 512 or cfg["block_k"] * cfg["k_sub"] >= 256)
                    assert all(cfg[key] & (cfg[key] - 1) == 0 for key in ("block_m", "block_n", "block_k",
                                                                            "split_k"))
                    assert not norm or cfg["split_k"] == 1
    assert fp8_gemv_config(1, 4096, 4096, (128, 128), torch.bfloat16)["block_k"] > 128  # grouped: wide tiles
    assert fp8_gemv_config(4, 4096, 4096, (1, 4096), torch.bfloat16)["block_k"] > 128  # a channel scale: too


@pytest.mark.parametrize("dtype,norm,residual,kind,split_k", [
    (torch.float32, False, False, "block", 1), (torch.bfloat16, False, False, "block", 2),
    (torch.float32, True, True, "block", 1), (torch.bfloat16, True, False, "rowblock", 1),
    (torch.float32, False, False, "rowblock", 3)])
def test_fp8_gemv_grouped_tiles_span_scale_columns(dtype, norm, residual, kind, split_k):
    """GROUPED (one row of x): a K tile of several 32-wide scale columns, its rows in one scale row (128-row blocks
    with 2 rows a program; one-row blocks with one), K ragged in the tile, a 16-bit tail, forced split-K."""
    n, k, tail_rows = 70, 200, 3
    block = (128, 32) if kind == "block" else (1, 32)
    q, scale = quantize_fp8_block_ref(randn(n, k, seed=21, scale=k ** -0.5), block)
    x = randn(1, k, dtype=dtype, seed=22)
    tail = randn(tail_rows, k, dtype=dtype, seed=23, scale=k ** -0.5)
    bias = randn(n + tail_rows, dtype=dtype, seed=24)
    bn = 2 if kind == "block" else 1
    assert _checked_mode(1, bn, 64, 2, False, block, k) == GROUPED
    if norm:
        r = randn(1, k, dtype=dtype, seed=25) if residual else None
        nw = (1 + 0.3 * randn(k, seed=26)).to(dtype)
        out = fp8_gemv_norm_triton(x, r, nw, 1e-6, q, scale, block, bias, True, tail=tail, block_n=bn, block_k=64,
                                   k_sub=2)
        ref = fp8_gemv_norm_ref(x, r, nw, 1e-6, q, scale, block, bias, True, tail)
        for field in ("y", "residual", "normed"):
            close(getattr(out, field), getattr(ref, field))
    else:
        out = fp8_gemv_triton(x, q, scale, block, bias, tail=tail, block_n=bn, block_k=64, k_sub=2, split_k=split_k)
        close(out, fp8_gemv_ref(x, q, scale, block, bias, tail))


def test_fp8_gemv_errors():
    q, scale, block = fp8_weight(8, 32)
    x = randn(2, 32)
    with pytest.raises(ValueError, match="SKINNY_MAX_M"):
        fp8_gemv_triton(randn(SKINNY_MAX_M + 1, 32), q, scale, block)
    with pytest.raises(ValueError, match="float8"):
        fp8_gemv_triton(x, q.float(), scale, block)
    with pytest.raises(ValueError, match="scale"):
        fp8_gemv_triton(x, q, scale.double(), block)
    with pytest.raises(ValueError, match="scale columns"):
        fp8_gemv_triton(randn(2, 300), *fp8_weight(8, 300)[:2], (128, 128), block_k=256)
    with pytest.raises(ValueError, match="tail"):
        fp8_gemv_triton(x, q, scale, block, tail=randn(3, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        fp8_gemv_triton(x, q, scale, block, randn(9))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 12288), (24576, 4096)])
def test_gpu_fp8_gemv_real_shapes(m, n, k):
    q, scale, block = fp8_weight(n, k, device="cuda")
    x = randn(m, k, dtype=torch.bfloat16, seed=2, device="cuda")
    bias = randn(n, dtype=torch.bfloat16, seed=3, device="cuda")
    for b in (None, bias):
        expected = fp8_gemv_ref(x, q, scale, block, b)
        close(fp8_gemv_triton(x, q, scale, block, b), expected)
        close(fp8_gemv_triton(x, q, scale, block, b, split_k=4), expected)
    nw = (1 + 0.3 * randn(k, seed=4, device="cuda")).bfloat16()
    r = randn(m, k, dtype=torch.bfloat16, seed=5, device="cuda")
    out = fp8_gemv_norm_triton(x, r, nw, 1e-6, q, scale, block, None, True)
    ref = fp8_gemv_norm_ref(x, r, nw, 1e-6, q, scale, block, None, True)
    close(out.y, ref.y)
    graph_out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()  # capturable: no autotuning, no host sync
    with torch.cuda.graph(graph):
        graph_out.copy_(fp8_gemv_triton(x, q, scale, block, bias))
    graph.replay()
    torch.cuda.synchronize()
    close(graph_out, fp8_gemv_ref(x, q, scale, block, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_fp8_gemv_lm_head_float32_logits(m):
    q, scale, block = fp8_weight(151936, 4096, device="cuda")
    x = randn(m, 4096, dtype=torch.bfloat16, seed=6, device="cuda")
    logits = fp8_gemv_triton(x, q, scale, block, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    close(logits.bfloat16(), fp8_gemv_ref(x, q, scale, block))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("n,k,kind", [(4096, 4096, "block"), (1024, 12288, "block"), (8192, 2048, "channel")])
def test_gpu_fp8_row_loop_bits(m, n, k, kind):
    q, scale, block = fp8_weight(n, k, kind, device="cuda")
    x = randn(m, k, dtype=torch.bfloat16, seed=7, device="cuda")
    tail = randn(64, k, dtype=torch.bfloat16, seed=8, scale=k ** -0.5, device="cuda")
    out = fp8_gemv_triton(x, q, scale, block, tail=tail, row_loop=True)
    assert torch.equal(out, torch.cat([fp8_gemv_triton(x[i:i + 1], q, scale, block, tail=tail) for i in range(m)]))
    close(out, fp8_gemv_ref(x, q, scale, block, None, tail))
    r = randn(m, k, dtype=torch.bfloat16, seed=9, device="cuda")
    nw = (1 + 0.3 * randn(k, seed=10, device="cuda")).bfloat16()
    normed = fp8_gemv_norm_triton(x, r, nw, 1e-6, q, scale, block, None, True, tail=tail, row_loop=True)
    singles = [fp8_gemv_norm_triton(x[i:i + 1], r[i:i + 1], nw, 1e-6, q, scale, block, None, True, tail=tail)
               for i in range(m)]
    for field in ("y", "residual", "normed"):
        assert torch.equal(getattr(normed, field), torch.cat([getattr(s, field) for s in singles])), field
