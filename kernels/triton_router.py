"""A MoE router at decode rows in one launch: the residual-add RMSNorm, the router projection and the routing.

At one decode row (and verify rows taken as decode rows) the router's norm and projection are one GEMV
(``gemv_norm_triton``), and the routing (``kernels/triton_moe_routing.py``) a second kernel that waits for it. Here
the GEMV's programs run as there; then each counts itself in on a counter, and the last to arrive, which then sees
every program's logits, routes the rows (``route_row``) and sets the counter back to zero for the next launch. The
logits are stored rounded to x's dtype, as the separate kernels store and read them, so the same experts are
picked; the weights may differ from the routing kernel's in their last bit (their softmax sums run over this
kernel's warps rather than its one warp). Every decode-row launch takes this path while it is on, so decode and
verify rows still agree bitwise.

``ROUTE_IN_ROUTER`` (``CONVEYOR_ROUTE_IN_ROUTER=1``; read at each call) turns it on: ``bench/b1_ablation.py``
variant ``route_in_router=1`` measures it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton
from kernels.triton_gemv import NormedProjection, _gemv_kernel, gemv_norm_triton
from kernels.triton_moe_routing import MAX_EXPERTS, MAX_TOP_K, route_row

ROUTE_IN_ROUTER = os.environ.get("CONVEYOR_ROUTE_IN_ROUTER", "0") == "1"


@dataclass(slots=True)
class RouteSpec:
    """What a MoE block routes by: ``top_k`` of ``experts`` routed experts (+ the shared expert's gate logit in
    column ``experts`` when ``shared_expert_id`` is set), renormalised or not; ``counter``: one int32 zero of the
    block's own on its device (the programs' arrival count)."""

    top_k: int
    experts: int
    renormalize: bool
    shared_expert_id: int | None
    counter: torch.Tensor


@dataclass(slots=True)
class RoutedProjection:
    """``NormedProjection`` with the rows' routing: ``weights`` fp32 [M, k (+1)], ``ids`` int32 [M, k (+1)]."""

    projection: NormedProjection
    weights: torch.Tensor
    ids: torch.Tensor


@_jit
def _norm_route_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, k_split, x_s0, r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, eps,
    counter_ptr, weights_ptr, ids_ptr, E, TOP_K, shared_id,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr, SHARED: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
    NORM: tl.constexpr = False, HAS_RES: tl.constexpr = False, WRITE_NORMED: tl.constexpr = False,
    WRITE_BLOCK: tl.constexpr = 16, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
    ROW_LOOP: tl.constexpr = False, K_STAGES: tl.constexpr = 1,
):
    """``_gemv_kernel``'s program, then the last program to arrive routes every row from the stored logits."""
    _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, k_split, x_s0, r_ptr, r_s0, nw_ptr, res_out_ptr,
                 normed_ptr, eps, HAS_BIAS, SPLIT, USE_DOT, DOT_FP32, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, NORM,
                 HAS_RES, WRITE_NORMED, WRITE_BLOCK, PREFETCH, PDL, ROW_LOOP, K_STAGES)
    tl.debug_barrier()  # every thread's stores issued before the program counts itself in (a release, gpu scope)
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        width = TOP_K + 1 if SHARED else TOP_K
        for row in range(M):
            route_row(y_ptr + row * N, 1, weights_ptr + row * width, ids_ptr + row * width, E, TOP_K, shared_id,
                      RENORMALIZE, SHARED, E_PAD, K_PAD)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


def applies(x: torch.Tensor) -> bool:
    """Whether a decode-row router projection of x routes in the same launch (``ROUTE_IN_ROUTER``, on the GPU)."""
    return ROUTE_IN_ROUTER and x.is_cuda


def norm_route_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, route: RouteSpec, write_normed: bool = False,
                      row_loop: bool = False) -> RoutedProjection:
    """``gemv_norm_triton(x, residual, norm_weight, eps, weight)`` and ``route_topk`` of its first
    ``route.experts (+1)`` columns in one launch (module docstring)."""
    shared = route.shared_expert_id is not None
    if not 1 <= route.experts <= MAX_EXPERTS or not 1 <= route.top_k <= min(route.experts, MAX_TOP_K):
        raise ValueError(f"need 1 <= top_k <= experts <= {MAX_EXPERTS} (top_k <= {MAX_TOP_K}), got top_k "
                         f"{route.top_k} of {route.experts}")
    if weight.shape[0] < route.experts + shared:
        raise ValueError(f"a router of {weight.shape[0]} rows cannot route {route.experts} experts"
                         f"{' and a shared gate' if shared else ''}")
    if route.counter.dtype != torch.int32 or route.counter.numel() != 1 or route.counter.device != x.device:
        raise ValueError("the counter must be one int32 on x's device")
    m, width = x.shape[0], route.top_k + shared
    weights = torch.empty(m, width, dtype=torch.float32, device=x.device)
    ids = torch.empty(m, width, dtype=torch.int32, device=x.device)
    args = (route.counter, weights, ids, route.experts, route.top_k, route.shared_expert_id if shared else 0)
    constexprs = dict(RENORMALIZE=bool(route.renormalize), SHARED=shared, E_PAD=triton.next_power_of_2(route.experts),
                      K_PAD=triton.next_power_of_2(route.top_k))
    projection = gemv_norm_triton(x, residual, norm_weight, eps, weight, None, write_normed, row_loop=row_loop,
                                  epilogue=(_norm_route_kernel, args, constexprs))
    return RoutedProjection(projection, weights, ids)
