"""The qkv projection with its prologue in one launch (``kernels/triton_qkv_projection.py``) against the two
kernels it replaces: ``gemv_norm_triton`` and ``qkv_prologue_triton`` on its q, k and v.

On CPU under the Triton interpreter (conftest); on a CUDA machine on the GPU, plus the ``gpu``-marked test.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.kv_cache import allocate_kv_cache
from kernels.triton_compat import triton
from kernels.triton_gemv import gemv_norm_config, gemv_norm_triton
from kernels.triton_qkv_projection import QkvPrologue, norm_qkv_triton
from kernels.triton_qkv_prologue import qkv_prologue_triton
from pipeline.models.rope import RotaryEmbedding

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
needs_triton = pytest.mark.skipif(triton is None or DEVICE == "cpu" and not INTERPRET,
                                  reason="needs triton (GPU or TRITON_INTERPRET=1)")


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype=dtype, device=DEVICE)


def layer(m: int, h: int, kvh: int, d: int, rot: int, gate: bool, norm: bool, neox: bool, rows: bool,
          dtype: torch.dtype = torch.float32, hidden: int = 64, seed: int = 0):
    """x, residual, the input norm's and the projection's weights, and a ``QkvPrologue`` over a fresh cache."""
    n = (h * (1 + gate) + 2 * kvh) * d
    x, residual = randn(m, hidden, dtype=dtype, seed=seed), randn(m, hidden, dtype=dtype, seed=seed + 1)
    norm_weight = 1 + 0.3 * randn(hidden, dtype=dtype, seed=seed + 2)
    weight = randn(n, hidden, dtype=dtype, seed=seed + 3, scale=hidden ** -0.5)
    qk = [1 + 0.1 * randn(d, dtype=dtype, seed=seed + 4 + i) for i in range(2)] if norm else [None, None]
    rope = RotaryEmbedding(d, rot, 4096, 10000.0, is_neox_style=neox, dtype=dtype, device=DEVICE)
    positions = torch.randint(0, 4000, (m,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    if rows:
        step = rope.step_rope(positions)
        cos, sin, row_ids = step.cos_table, step.sin_table, positions
    else:
        (cos, sin), row_ids = rope.cos_sin(positions), None
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(seed))[:m].to(DEVICE)
    if m > 1:
        slots[1] = -1  # a padding row writes nothing
    cache = allocate_kv_cache(1, 8, 4, kvh, d, dtype, DEVICE)[0]
    prologue = QkvPrologue(h, kvh, d, *qk, 1e-6, cos, sin, neox, cache, slots, row_ids,
                           torch.zeros(h + kvh, dtype=torch.int32, device=DEVICE))
    return x, residual, norm_weight, weight, prologue


def two_launches(x, residual, norm_weight, weight, p: QkvPrologue, row_loop: bool):
    block_n = gemv_norm_config(1, weight.shape[0], weight.shape[1], x.dtype)["block_n"]
    out = gemv_norm_triton(x, residual, norm_weight, 1e-6, weight, block_n=block_n, row_loop=row_loop)
    m, (h, kvh, d) = x.shape[0], (p.num_heads, p.num_kv_heads, p.head_dim)
    q = out.y[:, :h * d].view(m, h, d)
    k = out.y[:, h * d:(h + kvh) * d].view(m, kvh, d)
    v = out.y[:, (h + kvh) * d:(h + 2 * kvh) * d].view(m, kvh, d)
    qkv_prologue_triton(q, k, v, p.q_norm, p.k_norm, p.eps, p.cos, p.sin, p.is_neox_style, p.kv_cache_layer,
                        p.slot_mapping, p.rows)
    return out


@needs_triton
@pytest.mark.parametrize("m,row_loop", [(1, False), (3, True)])
@pytest.mark.parametrize("h,kvh,d,rot,gate,norm,neox,rows", [(4, 2, 16, 16, False, True, True, True),
                                                             (2, 1, 32, 16, True, True, False, True),
                                                             (4, 4, 16, 8, False, False, True, False)])
def test_one_launch_equals_the_two(m, row_loop, h, kvh, d, rot, gate, norm, neox, rows):
    """q and k normed and rotated, v and the rest (an output gate's heads) as projected, the cache and the new
    residual: bitwise the two kernels'; a padding row writes no cache slot; the counters are zero after each
    launch, so a second launch runs the prologue again."""
    x, residual, norm_weight, weight, p = layer(m, h, kvh, d, rot, gate, norm, neox, rows)
    ref = two_launches(x, residual, norm_weight, weight, p, row_loop)
    ref_cache = p.kv_cache_layer.clone()
    for _ in range(2):
        p.kv_cache_layer.zero_()
        got = norm_qkv_triton(x, residual, norm_weight, 1e-6, weight, p, row_loop=row_loop)
        assert torch.equal(got.y, ref.y) and torch.equal(got.residual, ref.residual)
        assert torch.equal(p.kv_cache_layer, ref_cache)
        assert torch.count_nonzero(p.counters) == 0


def test_rejects_bad_layouts():
    x, residual, norm_weight, weight, p = layer(1, 4, 2, 16, 16, False, True, True, True)
    with pytest.raises(ValueError, match="no room"):
        norm_qkv_triton(x, residual, norm_weight, 1e-6, weight[:-16], p)
    p.counters = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="counters"):
        norm_qkv_triton(x, residual, norm_weight, 1e-6, weight, p)


@pytest.mark.gpu
def test_gpu_one_launch_in_a_graph_equals_the_two():
    """bf16, the Qwen3-30B-A3B attention (32 q and 4 k/v heads of 128, q/k norms, a 21 MB projection of 2048)
    replayed in a CUDA graph under dependent launch, a new x and position each replay: q, k and the cache bitwise
    the two kernels'."""
    x, residual, norm_weight, weight, p = layer(1, 32, 4, 128, 128, False, True, True, True, torch.bfloat16, 2048)
    norm_qkv_triton(x, residual, norm_weight, 1e-6, weight, p)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = norm_qkv_triton(x, residual, norm_weight, 1e-6, weight, p)
    for seed in range(4):
        x.copy_(torch.randn(1, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        p.rows.copy_(torch.tensor([100 + 7 * seed], device="cuda"))
        p.kv_cache_layer.zero_()
        graph.replay()
        torch.cuda.synchronize()
        cache = p.kv_cache_layer.clone()
        p.kv_cache_layer.zero_()
        ref = two_launches(x, residual, norm_weight, weight, p, False)
        assert torch.equal(got.y, ref.y) and torch.equal(cache, p.kv_cache_layer)
        assert torch.count_nonzero(p.counters) == 0
