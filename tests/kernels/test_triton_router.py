"""The router in one launch (``kernels/triton_router.py``) against the two kernels it replaces: the norm and
projection of ``gemv_norm_triton`` and the routing of ``route_topk_triton`` on its logits.

On CPU under the Triton interpreter (conftest); on a CUDA machine on the GPU, plus the ``gpu``-marked test.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.triton_compat import triton
from kernels.triton_gemv import gemv_norm_triton
from kernels.triton_moe_routing import route_topk_triton
from kernels.triton_router import RouteSpec, norm_route_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
needs_triton = pytest.mark.skipif(triton is None or DEVICE == "cpu" and not INTERPRET,
                                  reason="needs triton (GPU or TRITON_INTERPRET=1)")
H = 64


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


def spec(top_k: int, experts: int, renormalize: bool, shared: bool) -> RouteSpec:
    return RouteSpec(top_k, experts, renormalize, experts if shared else None,
                     torch.zeros(1, dtype=torch.int32, device=DEVICE))


def separate(x, residual, norm_weight, weight, route: RouteSpec, row_loop: bool):
    """The two launches: the norm and projection, then the routing of its first columns."""
    out = gemv_norm_triton(x, residual, norm_weight, 1e-6, weight, None, True, row_loop=row_loop)
    shared = route.shared_expert_id is not None
    weights, ids = route_topk_triton(out.y[:, :route.experts + shared], route.top_k, route.renormalize,
                                     route.shared_expert_id)
    return out, weights, ids


@needs_triton
@pytest.mark.parametrize("m,row_loop", [(1, False), (3, True)])
@pytest.mark.parametrize("experts,top_k,renormalize,shared,rows", [(16, 4, True, False, 16), (12, 2, False, True, 16),
                                                                    (8, 8, True, False, 8)])
def test_one_launch_routes_as_the_two(m, row_loop, experts, top_k, renormalize, shared, rows):
    """The same logits, residual and normed rows bitwise, the same experts, the same weights (to fp32 rounding:
    the sums run over other lanes), in rows padded past the experts and with a shared gate column; the counter is
    zero again after each launch, so a second launch routes again."""
    x, residual = randn(m, H, seed=1), randn(m, H, seed=2)
    norm_weight, weight = randn(H, seed=3), randn(rows, H, seed=4)
    route = spec(top_k, experts, renormalize, shared)
    ref, ref_weights, ref_ids = separate(x, residual, norm_weight, weight, route, row_loop)
    for _ in range(2):
        got = norm_route_triton(x, residual, norm_weight, 1e-6, weight, route, True, row_loop=row_loop)
        assert int(route.counter.item()) == 0
        assert torch.equal(got.projection.y, ref.y)
        assert torch.equal(got.projection.residual, ref.residual) and torch.equal(got.projection.normed, ref.normed)
        assert torch.equal(got.ids, ref_ids)
        torch.testing.assert_close(got.weights, ref_weights, atol=1e-6, rtol=1e-6)
        assert got.weights.shape == (m, top_k + shared)


@needs_triton
def test_without_a_residual_x_is_the_residual():
    x, norm_weight, weight = randn(1, H, seed=5), randn(H, seed=6), randn(16, H, seed=7)
    route = spec(2, 16, True, False)
    ref, ref_weights, ref_ids = separate(x, None, norm_weight, weight, route, False)
    got = norm_route_triton(x, None, norm_weight, 1e-6, weight, route, True)
    assert torch.equal(got.ids, ref_ids) and torch.equal(got.projection.y, ref.y)
    assert got.projection.residual is x


def test_rejects_bad_routes():
    x, norm_weight, weight = randn(1, H), randn(H), randn(16, H)
    for bad in (spec(0, 16, True, False), spec(17, 16, True, False), spec(2, 16, True, True)):  # 17 rows needed
        with pytest.raises(ValueError):
            norm_route_triton(x, None, norm_weight, 1e-6, weight, bad)
    counter64 = RouteSpec(2, 16, True, None, torch.zeros(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="counter"):
        norm_route_triton(x, None, norm_weight, 1e-6, weight, counter64)


@pytest.mark.gpu
def test_gpu_one_launch_in_a_graph_routes_as_the_two():
    """bf16, the Qwen3-30B-A3B router (128 experts, top 8) and the Qwen3.5 one (256 + a shared gate in 264 rows),
    replayed in a CUDA graph under dependent launch: the same experts and logits as the two kernels at every
    replay, for a new x each time."""
    for experts, rows, top_k, shared in ((128, 128, 8, False), (256, 264, 8, True)):
        x = torch.empty(1, 2048, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn(1, 2048, device="cuda").bfloat16()
        norm_weight = (torch.rand(2048, device="cuda") + 0.5).bfloat16()
        weight = (torch.randn(rows, 2048, device="cuda") * 0.05).bfloat16()
        route = RouteSpec(top_k, experts, True, experts if shared else None,
                          torch.zeros(1, dtype=torch.int32, device="cuda"))
        x.copy_(torch.randn(1, 2048, device="cuda"))
        norm_route_triton(x, residual, norm_weight, 1e-6, weight, route, True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = norm_route_triton(x, residual, norm_weight, 1e-6, weight, route, True)
        for seed in range(4):
            x.copy_(torch.randn(1, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
            graph.replay()
            torch.cuda.synchronize()
            ref, ref_weights, ref_ids = separate(x, residual, norm_weight, weight, route, False)
            assert torch.equal(got.projection.y, ref.y) and torch.equal(got.ids, ref_ids)
            torch.testing.assert_close(got.weights, ref_weights, atol=1e-6, rtol=1e-6)
            assert int(route.counter.item()) == 0
