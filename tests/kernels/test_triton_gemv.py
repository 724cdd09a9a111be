"""Skinny GEMM (decode linear layers, M <= 16) against its torch reference.

On CPU the kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1) on tiny shapes; there bf16
casts truncate instead of rounding, so bf16 is compared within two ulps of the output. The interpreter runs the
dot path in fp32 (its 16-bit tl.dot is wrong), so the 16-bit tensor-core path itself is checked by the gpu tests.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.triton_gemv import SKINNY_MAX_M, gemv_config, gemv_ref, gemv_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: summation-order error, relative to the output's magnitude; 16-bit: two ulps (2**-7 for bf16)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.float().abs().max().item() + 1.0
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5 * scale, rtol=1e-5)
    else:
        ulp = torch.finfo(expected.dtype).eps
        torch.testing.assert_close(actual.float(), expected.float(), atol=2 * ulp * scale, rtol=2 * ulp)


def operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    x = randn(m, k, dtype=dtype, seed=seed)
    weight = randn(n, k, dtype=dtype, seed=seed + 1, scale=k**-0.5)
    return x, weight, randn(n, dtype=dtype, seed=seed + 2) if bias else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(1, 16), (7, 100), (64, 256), (130, 100)])
def test_gemv_default_heuristic(dtype, m, n, k):
    x, weight, bias = operands(m, n, k, dtype, bias=n % 2 == 0)
    close(gemv_triton(x, weight, bias), gemv_ref(x, weight, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,split_k", [(1, 130, 256, 4), (3, 7, 100, 3), (16, 64, 256, 2), (2, 33, 1000, 8)])
def test_gemv_split_k_and_paths(dtype, use_dot, bias, m, n, k, split_k):
    """Forced split-K (workspace + reduce kernel, a ragged last split too) on both the FMA and the dot path."""
    x, weight, b = operands(m, n, k, dtype, bias)
    block_n, block_k = (16, 64) if use_dot else (4, 64)
    out = gemv_triton(x, weight, b, block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot)
    close(out, gemv_ref(x, weight, b))


@pytest.mark.parametrize("split_k", [None, 3])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_float32_output_is_the_rounded_output(m, split_k):
    """``out_dtype=float32`` (logits) stores the values the bf16 output holds: one program's store and the split-K
    reduce's, bias included."""
    x, weight, bias = operands(m, 70, 200, torch.bfloat16, bias=True)
    kw = {} if split_k is None else {"split_k": split_k, "block_n": 16, "block_k": 32}
    wide = gemv_triton(x, weight, bias, out_dtype=torch.float32, **kw)
    assert wide.dtype == torch.float32 and torch.equal(wide, gemv_triton(x, weight, bias, **kw).float())
    assert gemv_triton(x[:0], weight, out_dtype=torch.float32).dtype == torch.float32


def test_gemv_strided_x_and_zero_sizes():
    x, weight, bias = operands(4, 64, 256, torch.float32, bias=True)
    wide = randn(4, 512)
    wide[:, :256] = x
    close(gemv_triton(wide[:, :256], weight, bias), gemv_ref(x, weight, bias))  # row stride 512
    close(gemv_triton(x.t().contiguous().t(), weight), gemv_ref(x, weight))  # column-major x
    assert gemv_triton(x[:0], weight).shape == (0, 64)
    torch.testing.assert_close(gemv_triton(x[:, :0], weight[:, :0], bias), bias.expand(4, 64))


def test_gemv_config_is_deterministic_and_valid():
    for m in range(1, SKINNY_MAX_M + 1):
        for n, k in [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (1024, 4096), (5, 3)]:
            for dtype in (torch.bfloat16, torch.float32):
                cfg = gemv_config(m, n, k, dtype)
                assert cfg == gemv_config(m, n, k, dtype)
                assert cfg["block_m"] >= m and all(cfg[key] & (cfg[key] - 1) == 0 for key in
                                                   ("block_m", "block_n", "block_k", "split_k"))
                if cfg["use_dot"]:
                    assert min(cfg["block_m"], cfg["block_n"], cfg["block_k"]) >= 16
    assert gemv_config(1, 4096, 4096, torch.bfloat16)["split_k"] == 1  # enough N tiles: no reduce kernel
    assert gemv_config(16, 512, 12288, torch.bfloat16)["split_k"] > 1  # 8 N tiles of 64 rows: split K


def test_gemv_errors():
    x, weight, bias = operands(2, 8, 32, torch.float32, bias=True)
    with pytest.raises(ValueError, match="SKINNY_MAX_M"):
        gemv_triton(randn(SKINNY_MAX_M + 1, 32), weight)
    with pytest.raises(ValueError, match="weight"):
        gemv_triton(x, randn(8, 33))
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        gemv_triton(x[0], weight)
    with pytest.raises(ValueError, match="dtype"):
        gemv_triton(x, weight.bfloat16())
    with pytest.raises(ValueError, match="dtype"):
        gemv_triton(x.double(), weight.double())
    with pytest.raises(ValueError, match="contiguous"):
        gemv_triton(x, randn(32, 8).t())
    with pytest.raises(ValueError, match="bias"):
        gemv_triton(x, weight, bias[:4])
    with pytest.raises(ValueError, match="powers of two"):
        gemv_triton(x, weight, block_n=3)
    with pytest.raises(ValueError, match="powers of two"):
        gemv_triton(x, weight, block_n=8, use_dot=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 12288)])
def test_gpu_gemv_bf16_real_shapes(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    for b in (None, bias):
        expected = gemv_ref(x, weight, b)
        close(gemv_triton(x, weight, b), expected)
        close(gemv_triton(x, weight, b, split_k=4), expected)
    graph_out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()  # the default launch is capturable (no autotuning, no host sync)
    with torch.cuda.graph(graph):
        graph_out.copy_(gemv_triton(x, weight, bias))
    graph.replay()
    torch.cuda.synchronize()
    close(graph_out, gemv_ref(x, weight, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("norm_dtype", ["same", "fp32"])
def test_gemv_norm_matches_norm_then_gemv(dtype, m, residual, norm_dtype):
    """The residual-add RMSNorm inside the GEMV (``gemv_norm_triton``) against the norm then the projection:
    the output, the new residual and the normed rows (an fp32 norm weight is a zero-centred norm's 1 + w)."""
    from kernels.triton_gemv import gemv_norm_ref, gemv_norm_triton

    n, k = 70, 200  # K ragged against every block size
    x, weight, bias = operands(m, n, k, dtype, bias=residual)
    r = randn(m, k, dtype=dtype, seed=7) if residual else None
    norm_weight = (1 + 0.3 * randn(k, seed=8)).to(dtype if norm_dtype == "same" else torch.float32)
    out = gemv_norm_triton(x, r, norm_weight, 1e-6, weight, bias, write_normed=True)
    ref = gemv_norm_ref(x, r, norm_weight, 1e-6, weight, bias, write_normed=True)
    close(out.y, ref.y)
    close(out.residual, ref.residual)
    close(out.normed, ref.normed)
    assert out.residual is x if r is None else out.residual.data_ptr() not in (x.data_ptr(), r.data_ptr())


@pytest.mark.parametrize("block_n,block_k", [(1, 16), (8, 64), (2, 256)])
def test_gemv_norm_every_program_writes_its_slice(block_n, block_k):
    """The new residual and the normed rows are written in slices by the programs (70 programs of one row, or 9, or
    35 for K = 300): every element is written, whatever the grid."""
    from kernels.triton_gemv import gemv_norm_ref, gemv_norm_triton

    x, weight, _ = operands(2, 70, 300, torch.float32, bias=False)
    r = randn(2, 300, seed=3)
    norm_weight = 1 + 0.3 * randn(300, seed=4)
    out = gemv_norm_triton(x, r, norm_weight, 1e-5, weight, None, True, block_n=block_n, block_k=block_k)
    ref = gemv_norm_ref(x, r, norm_weight, 1e-5, weight, None, True)
    assert torch.equal(out.residual, ref.residual)
    close(out.normed, ref.normed)
    close(out.y, ref.y)


def test_gemv_norm_config_has_no_k_split():
    from kernels.triton_gemv import gemv_norm_config

    for m, n, k in [(1, 128, 2048), (1, 12352, 2048), (4, 9216, 2048), (16, 64, 8192)]:
        cfg = gemv_norm_config(m, n, k, torch.bfloat16)
        assert cfg["split_k"] == 1
        assert (cfg["block_n"], cfg["block_k"]) == ((8, 512) if m == 1 and n >= 1024 else
                                                    (gemv_config(m, n, k, torch.bfloat16)["block_n"],
                                                     gemv_config(m, n, k, torch.bfloat16)["block_k"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,block_k,split_k", [(1, 70, 200, 256, 1), (1, 70, 200, 64, 1), (3, 9, 300, 64, 2),
                                                   (1, 33, 1000, 64, 4)])
def test_gemv_prefetched_first_tile(dtype, m, n, k, block_k, split_k):
    """PREFETCH (on under PDL) loads each program's first W tile before the loop and starts the loop one tile
    later: one whole-row tile, several tiles, a ragged last tile, K splits (every split's own first tile)."""
    x, weight, bias = operands(m, n, k, dtype, bias=True)
    out = gemv_triton(x, weight, bias, block_n=4, block_k=block_k, split_k=split_k, use_dot=False, prefetch=True)
    close(out, gemv_ref(x, weight, bias))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("block_k", [256, 64])
def test_gemv_norm_prefetched_first_tile(residual, block_k):
    from kernels.triton_gemv import gemv_norm_ref, gemv_norm_triton

    x, weight, _ = operands(1, 70, 200, torch.bfloat16, bias=False)
    r = randn(1, 200, dtype=torch.bfloat16, seed=7) if residual else None
    norm_weight = 1 + 0.3 * randn(200, seed=8)
    out = gemv_norm_triton(x, r, norm_weight.bfloat16(), 1e-6, weight, None, True, block_n=8, block_k=block_k,
                           prefetch=True)
    ref = gemv_norm_ref(x, r, norm_weight.bfloat16(), 1e-6, weight, None, True)
    close(out.y, ref.y)
    close(out.normed, ref.normed)
    close(out.residual, ref.residual)


def test_gemv_norm_pdl_config_takes_whole_rows_when_the_programs_would_not_fill_the_gpu():
    """Under PDL a norm-GEMV whose programs would not outnumber the SMs (a router: 128 or 264 rows of 2,048) takes
    whole rows, about one program an SM; projections that fill the GPU, M > 1, no PDL and rows too long for the
    register budget keep the table's tiles."""
    from kernels.triton_gemv import gemv_norm_config

    def tile(m, n, k, pdl=True, sms=132):
        cfg = gemv_norm_config(m, n, k, torch.bfloat16, sms, pdl=pdl)
        return cfg["block_n"], cfg["block_k"], cfg["split_k"]

    assert tile(1, 128, 2048) == (1, 2048, 1)
    assert tile(1, 264, 2048) == (2, 2048, 1)
    assert tile(1, 128, 2048, sms=78) == (2, 2048, 1)
    assert tile(1, 128, 1000) == (1, 1024, 1)  # a ragged row: one tile, masked
    assert tile(1, 5120, 2048) == (8, 512, 1) == tile(1, 5120, 2048, pdl=False)
    assert tile(1, 128, 8192) == tile(1, 128, 8192, pdl=False)  # [1, 8192] fp32 would pass 32 registers a thread
    assert tile(4, 128, 2048) == tile(4, 128, 2048, pdl=False)
    assert tile(1, 128, 2048, pdl=False) == (2, 1024, 1)


@pytest.mark.parametrize("block_n", [1, 2])
def test_gemv_norm_whole_row_tiles(block_n):
    """The router's whole-row tiles (one or two rows a program, the row one tile, loaded before the wait): the
    same projection, new residual and normed rows as the reference."""
    from kernels.triton_gemv import gemv_norm_ref, gemv_norm_triton

    x, weight, _ = operands(1, 70, 200, torch.bfloat16, bias=False)
    r = randn(1, 200, dtype=torch.bfloat16, seed=9)
    norm_weight = (1 + 0.3 * randn(200, seed=10)).bfloat16()
    out = gemv_norm_triton(x, r, norm_weight, 1e-6, weight, None, True, block_n=block_n, block_k=256, prefetch=True)
    ref = gemv_norm_ref(x, r, norm_weight, 1e-6, weight, None, True)
    close(out.y, ref.y)
    close(out.normed, ref.normed)
    close(out.residual, ref.residual)


def split_rows(fn, x: torch.Tensor, *rest):
    """``fn`` called on each row of x (and of a residual in ``rest``) alone, the rows stacked."""
    return [fn(x[i:i + 1], *(r[i:i + 1] if isinstance(r, torch.Tensor) and r.shape == x.shape else r for r in rest))
            for i in range(x.shape[0])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(2, 130, 256), (3, 7, 9000), (16, 64, 300)])  # (3, 7, 9000): a K split
def test_row_loop_gives_each_row_its_one_row_bits(dtype, m, n, k):
    """Speculative verify rows against one-token decode rows: the same bits, not merely close ones."""
    x, w, b = operands(m, n, k, dtype, True, seed=3)
    wide = torch.cat([x, x], dim=1)[:, :k]  # a strided x as well
    for rows in (x, wide):
        out = gemv_triton(rows, w, b, row_loop=True)
        assert torch.equal(out, torch.cat(split_rows(lambda r: gemv_triton(r, w, b), rows)))
        close(out, gemv_ref(rows, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_row_loop_gives_each_row_its_one_row_bits(dtype, residual):
    from kernels.triton_gemv import gemv_norm_ref, gemv_norm_triton

    m, n, k = 4, 70, 200
    x, w, b = operands(m, n, k, dtype, True, seed=5)
    r = randn(m, k, dtype=dtype, seed=9) if residual else None
    nw = (1 + 0.3 * randn(k, seed=8)).to(dtype)
    out = gemv_norm_triton(x, r, nw, 1e-6, w, b, True, row_loop=True)
    singles = [gemv_norm_triton(x[i:i + 1], None if r is None else r[i:i + 1], nw, 1e-6, w, b, True)
               for i in range(m)]
    for field in ("y", "residual", "normed"):
        assert torch.equal(getattr(out, field), torch.cat([getattr(s, field) for s in singles])), field
    ref = gemv_norm_ref(x, r, nw, 1e-6, w, b, True)
    close(out.y, ref.y)
    close(out.normed, ref.normed)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 12288), (8192, 2048), (151936, 1024)])  # the last two: TMA
def test_gpu_row_loop_bits(m, n, k):
    from kernels.triton_gemv import gemv_norm_triton

    x, w, _ = operands(m, n, k, torch.bfloat16, False, seed=1)
    r, nw = randn(m, k, dtype=torch.bfloat16, seed=2), (1 + 0.3 * randn(k, seed=3)).to(torch.bfloat16)
    out = gemv_triton(x, w, row_loop=True)
    assert torch.equal(out, torch.cat(split_rows(lambda row: gemv_triton(row, w), x)))
    close(out, gemv_ref(x, w))
    normed = gemv_norm_triton(x, r, nw, 1e-6, w, None, True, row_loop=True)
    singles = [gemv_norm_triton(x[i:i + 1], r[i:i + 1], nw, 1e-6, w, None, True) for i in range(m)]
    for field in ("y", "residual", "normed"):
        assert torch.equal(getattr(normed, field), torch.cat([getattr(s, field) for s in singles])), field
