"""MoE routing (softmax over the experts, top-k, optional renormalisation) in one Triton kernel.

Semantics and the torch oracle are ``kernels.moe.route_topk_ref``. In torch the routing is ~7 small kernels a
layer (softmax, topk with its sort, sum, div, casts), which dominated the batch-1 MoE decode step; here one
program per token reads its row of router logits once and writes ``k`` weights and ids.

The row (experts padded to a power of two) is held in registers. The top-k are picked on the logits themselves
(softmax is monotonic, so the order is the probabilities' without any rounding of ``exp`` reordering them) by k
rounds of one max over int64 keys, each the logit's bits in an order-preserving form above the expert's index
complemented: the largest logit, ties to the lower expert id, in one reduction a round. ``torch.topk`` leaves the
order of ties unspecified (on CPU it is not lowest-index-first), so the two can differ only on tied experts. The
chosen weights are ``exp(x - max) / sum(exp(x - max))`` in fp32, then divided by their sum when ``renormalize``.
With a shared expert (its gate logit in the last column) the row also gets slot k: the shared expert's id and
sigmoid(logit) in fp32. No host sync and output sizes fixed by the input's shape: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import pdl_launch, pdl_wait
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton

MAX_EXPERTS = 1024  # a row lives in registers (at most 16 fp32 a thread)
MAX_TOP_K = 32


@_jit
def logit_of(key):
    """The logit a routing key (below) was made from."""
    ordered = (key >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@_jit
def _route_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, E, TOP_K, stride_t, stride_e, shared_id,
    RENORMALIZE: tl.constexpr, SHARED: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """E routed experts; SHARED: column E is the shared expert's gate logit, written as slot TOP_K."""
    pdl_wait(PDL)  # dependent launch: kernels/triton_compat.py
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    valid = offs < E
    row = tl.load(logits_ptr + tok * stride_t + offs * stride_e, mask=valid, other=float("-inf")).to(tl.float32)
    # One int64 key an expert: the logit's bits made order-preserving (negative floats' magnitude bits flipped; -0
    # taken as +0 first) above the expert's complement index, so one max gives the largest logit and, among ties, the
    # lowest expert. The taken key is retired; padding is retired from the start.
    bits = tl.where(row == 0.0, 0.0, row).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | (E_PAD - 1 - offs).to(tl.int64)
    retired = tl.full((E_PAD,), -(1 << 63), dtype=tl.int64)
    key = tl.where(valid, key, retired)
    slots = tl.arange(0, K_PAD)
    best = tl.max(key, axis=0)  # the first pick: the row's maximum
    key = tl.where(key == best, retired, key)
    top_key = tl.where(slots == 0, best, tl.full((K_PAD,), 0, dtype=tl.int64))
    peak = logit_of(best)
    for j in range(1, TOP_K):
        best = tl.max(key, axis=0)
        key = tl.where(key == best, retired, key)
        top_key = tl.where(slots == j, best, top_key)
    top_i = (E_PAD - 1 - (top_key & 0xFFFFFFFF)).to(tl.int32)
    top_v = logit_of(top_key)
    denominator = tl.sum(tl.where(valid, tl.exp(row - peak), 0.0), axis=0)
    top_w = tl.where(slots < TOP_K, tl.exp(top_v - peak) / denominator, 0.0)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(slots < TOP_K, top_w, 0.0), axis=0)
    width = TOP_K + 1 if SHARED else TOP_K
    out = tok * width + slots
    tl.store(weights_ptr + out, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + out, top_i, mask=slots < TOP_K)
    if SHARED:
        gate = tl.load(logits_ptr + tok * stride_t + E * stride_e).to(tl.float32)
        tl.store(weights_ptr + tok * width + TOP_K, 1.0 / (1.0 + tl.exp(-gate)))
        tl.store(ids_ptr + tok * width + TOP_K, shared_id)


def route_topk_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                      shared_expert_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``route_topk_ref`` except the ids are int32 (and ties go to the lower expert id):
    ``(topk_weights fp32 [T, k (+1)], topk_ids int32 [T, k (+1)])``. Any float dtype and any strides."""
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(f"router logits must be a float [T, E] tensor, got {router_logits.dtype} "
                         f"{tuple(router_logits.shape)}")
    shared = shared_expert_id is not None
    t, e = router_logits.shape
    e -= shared
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"need 1 <= E <= {MAX_EXPERTS} experts, got {e}")
    if not 1 <= top_k <= min(e, MAX_TOP_K):
        raise ValueError(f"need 1 <= top_k <= min(E, {MAX_TOP_K}) = {min(e, MAX_TOP_K)}, got {top_k}")
    weights = torch.empty(t, top_k + shared, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k + shared, dtype=torch.int32, device=router_logits.device)
    if t == 0:
        return weights, ids
    _route_topk_kernel[(t,)](
        router_logits, weights, ids, e, top_k, router_logits.stride(0), router_logits.stride(1),
        shared_expert_id if shared else 0, RENORMALIZE=bool(renormalize), SHARED=shared,
        E_PAD=triton.next_power_of_2(e), K_PAD=triton.next_power_of_2(top_k),
        # one warp keeps the k + 2 reductions in shuffles, the fastest for E 128..512 at T 1..4096
        num_warps=1 if e <= 512 else 4, **pdl_launch(router_logits),
    )
    return weights, ids
