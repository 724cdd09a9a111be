"""The fused routing kernel (``kernels/triton_moe_routing.py``) against ``route_topk_ref``.

On CPU the kernel runs under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on tiny shapes.

Ties: the kernel gives tied experts in ascending expert id. ``torch.topk`` does not promise an order for ties, and
on CPU it is not lowest-index-first (all-equal rows of 8 logits come back as 4, 7, 6, 5, ...), so ids are compared
with ``route_topk_ref`` only on tie-free logits; tied rows are checked against the rule itself
(``lowest_first_ref``: a stable descending sort) and against the reference's weights, which ties do not change.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.moe import route_topk_ref
from kernels.triton_compat import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"

needs_triton = pytest.mark.skipif(triton is None or DEVICE == "cpu" and not INTERPRET,
                                  reason="needs triton (GPU or TRITON_INTERPRET=1)")


def logits(t: int, e: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Tie-free rows. fp32: normal with std 2. 16-bit dtypes would round random logits into ties, so each row is a
    random permutation of ``e`` distinct grid points in [-4, 4) (exact in bf16 and fp16)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        x = torch.randn(t, e, generator=gen) * 2
    else:
        perms = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]) if t else torch.zeros(0, e)
        x = (perms.float() - e / 2) * (8 / triton.next_power_of_2(e))
    return x.to(dtype=dtype, device=DEVICE)


def lowest_first_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """The kernel's rule spelled out: softmax in fp32, the k largest with ties in ascending expert id."""
    x = router_logits.float()
    ids = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.softmax(x, dim=-1).gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check(router_logits: torch.Tensor, top_k: int, renormalize: bool, ties: bool = False) -> None:
    from kernels.triton_moe_routing import route_topk_triton

    weights, ids = route_topk_triton(router_logits, top_k, renormalize)
    t = router_logits.shape[0]
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (t, top_k)
    ref_w, ref_ids = route_topk_ref(router_logits.contiguous(), top_k, renormalize)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)
    rule_w, rule_ids = lowest_first_ref(router_logits, top_k, renormalize)
    assert torch.equal(ids.long(), rule_ids)
    torch.testing.assert_close(weights, rule_w, atol=1e-6, rtol=1e-5)
    if not ties:
        assert torch.equal(ids.long(), ref_ids)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [0, 1, 3, 17])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("e", [8, 60, 128, 256])
def test_matches_reference(e, k, renormalize, t, dtype):
    check(logits(t, e, dtype, seed=1000 * e + 10 * k + t), k, renormalize)


@needs_triton
@pytest.mark.parametrize("e,k", [(512, 16), (60, 16), (16, 16)])  # Qwen3.5's widest; k = E
def test_wide_and_large_k(e, k):
    check(logits(2, e, seed=e + k), k, True)
    check(logits(2, e, torch.float16, seed=e - k), k, False)


@needs_triton
def test_strided_views():
    """A row-strided view (the router's output sliced from a wider buffer), a column-strided one and a transpose:
    read in place, the same as the reference on a contiguous copy."""
    wide = logits(5, 128, torch.bfloat16, seed=3)
    rows = wide[1:4, 32:96]
    assert rows.stride() == (128, 1)
    check(rows, 8, True)
    check(wide[:, ::2], 4, False)
    check(logits(40, 3, seed=4).t(), 2, True)  # [3, 40], strides (1, 3)


@needs_triton
@pytest.mark.parametrize("renormalize", [True, False])
def test_ties_go_to_the_lower_expert(renormalize):
    x = torch.zeros(3, 16, device=DEVICE)
    x[1, [12, 3, 9]] = 1.0  # three equal maxima, then thirteen equal rest
    x[2, 5] = float("-inf")
    x[2, 1] = 2.0
    from kernels.triton_moe_routing import route_topk_triton

    weights, ids = route_topk_triton(x, 4, renormalize)
    assert ids.tolist() == [[0, 1, 2, 3], [3, 9, 12, 0], [1, 0, 2, 3]]
    if renormalize:
        torch.testing.assert_close(weights[0], torch.full((4,), 0.25, device=DEVICE))
    else:
        torch.testing.assert_close(weights[0], torch.full((4,), 1 / 16, device=DEVICE))
    check(x, 4, renormalize, ties=True)


@needs_triton
def test_ties_in_rounded_bf16_logits():
    """Random bf16 logits tie often (8-bit mantissa): the rule holds and the weights equal the reference's."""
    x = (torch.randn(6, 256, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16).to(DEVICE)
    top = torch.sort(x.float(), dim=-1, descending=True).values[:, :9]
    assert (top[:, 1:] == top[:, :-1]).any(), "the fixture should hold a tie among the top 9"
    check(x, 8, True, ties=True)
    check(x, 8, False, ties=True)


@needs_triton
def test_minus_inf_logits_are_picked_once():
    """Fewer finite logits than k: the masked experts fill the tail with weight 0, each at most once."""
    from kernels.triton_moe_routing import route_topk_triton

    x = torch.full((2, 8), float("-inf"), device=DEVICE)
    x[0, 6], x[0, 2] = 1.0, 0.0
    x[1, 4] = 3.0
    weights, ids = route_topk_triton(x, 4, True)
    assert ids.tolist() == [[6, 2, 0, 1], [4, 0, 1, 2]]
    assert weights[:, 2:].eq(0).all() and weights[1, 0] == 1
    torch.testing.assert_close(weights.sum(1), torch.ones(2, device=DEVICE))


def test_rejects_bad_inputs():
    from kernels.triton_moe_routing import route_topk_triton

    x = torch.zeros(2, 8)
    for bad, k in [(x[0], 1), (x[None], 1), (x, 0), (x, 9), (torch.zeros(2, 64), 33), (torch.zeros(2, 2048), 2),
                   (x.long(), 2), (torch.zeros(2, 0), 1)]:
        with pytest.raises(ValueError):
            route_topk_triton(bad, k, True)
    weights, ids = route_topk_triton(torch.zeros(0, 8), 2, True)  # no launch
    assert weights.shape == ids.shape == (0, 2) and weights.dtype == torch.float32 and ids.dtype == torch.int32


@pytest.mark.gpu
@needs_triton
def test_cuda_graph_capture():
    from kernels.triton_moe_routing import route_topk_triton

    static = logits(4, 128, torch.bfloat16, seed=6)
    route_topk_triton(static, 8, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_topk_triton(static, 8, True)
    fresh = logits(4, 128, torch.bfloat16, seed=7)
    static.copy_(fresh)
    graph.replay()
    ref_w, ref_ids = route_topk_ref(fresh, 8, True)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)


def test_route_topk_takes_the_reference_off_cuda():
    """``kernels.moe.route_topk`` (what the MoE block calls) is the torch reference on a CPU tensor."""
    from kernels.moe import route_topk

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = route_topk(x, 2, True)
    ref_w, ref_ids = route_topk_ref(x, 2, True)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)


@needs_triton
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_expert_slot(renormalize, dtype):
    """With a shared expert, the last logit column is its gate: top-k over the others (as without it), then slot k
    holds the shared expert's id and sigmoid(gate logit); the reference agrees."""
    from kernels.triton_moe_routing import route_topk_triton

    routed = logits(13, 16, dtype, seed=5)
    gate = (torch.linspace(-6, 6, 13) if dtype == torch.float32 else torch.linspace(-4, 4, 13)).to(routed)
    full = torch.cat([routed, gate[:, None]], dim=1)
    weights, ids = route_topk_triton(full, 4, renormalize, shared_expert_id=16)
    assert weights.shape == ids.shape == (13, 5)
    plain_w, plain_ids = route_topk_triton(routed, 4, renormalize)
    assert torch.equal(weights[:, :4], plain_w) and torch.equal(ids[:, :4], plain_ids)
    assert (ids[:, 4] == 16).all()
    torch.testing.assert_close(weights[:, 4], torch.sigmoid(gate.float()), atol=1e-6, rtol=1e-5)
    ref_w, ref_ids = route_topk_ref(full, 4, renormalize, shared_expert_id=16)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)
    assert torch.equal(ids.long(), ref_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_expert_slot_reference(dtype):
    """``route_topk_ref`` with a shared expert: the routed k exactly as without the gate column (softmax over the
    routed columns only), then the shared id with sigmoid of the gate logit taken in fp32."""
    full = (torch.randn(6, 9, generator=torch.Generator().manual_seed(8)) * 2).to(dtype)
    for renormalize in (True, False):
        weights, ids = route_topk_ref(full, 3, renormalize, shared_expert_id=40)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and weights.shape == ids.shape == (6, 4)
        plain_w, plain_ids = route_topk_ref(full[:, :8], 3, renormalize)
        assert torch.equal(weights[:, :3], plain_w) and torch.equal(ids[:, :3], plain_ids)
        assert (ids[:, 3] == 40).all() and torch.equal(weights[:, 3], torch.sigmoid(full[:, 8].float()))
        if renormalize:
            torch.testing.assert_close(weights[:, :3].sum(1), torch.ones(6))


@needs_triton
def test_shared_expert_slot_strided_empty_and_bad():
    """The gate column read through any strides; no tokens, no launch; the shared column is not a routed expert."""
    from kernels.triton_moe_routing import route_topk_triton

    wide = logits(4, 40, seed=9)
    for view in (wide[:, 3:20], wide[:, ::4], logits(17, 4, seed=10).t()):  # 16 + 1, 9 + 1, 3 + 1 columns
        weights, ids = route_topk_triton(view, 2, True, shared_expert_id=99)
        ref_w, ref_ids = route_topk_ref(view.contiguous(), 2, True, shared_expert_id=99)
        assert weights.shape == (view.shape[0], 3) and torch.equal(ids.long(), ref_ids)
        torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)
    weights, ids = route_topk_triton(torch.zeros(0, 9, device=DEVICE), 2, False, shared_expert_id=8)
    assert weights.shape == ids.shape == (0, 3)
    for bad, k in [(torch.zeros(2, 1), 1), (torch.zeros(2, 5), 5)]:  # no routed expert; k above the 4 routed
        with pytest.raises(ValueError):
            route_topk_triton(bad.to(DEVICE), k, True, shared_expert_id=4)


@needs_triton
def test_signed_zeros_and_negative_logits_keep_their_order():
    """The keys order floats through their bits: -0.0 ties +0.0 (lower expert first) and negative logits order by
    value, the most negative last, -inf after them."""
    x = torch.tensor([[-1.5, -3.0, -0.0, -1e-30, -2.0, 0.0, float("-inf"), -1.0]], device=DEVICE)
    from kernels.triton_moe_routing import route_topk_triton

    _, ids = route_topk_triton(x, 8, False)
    assert ids.tolist() == [[2, 5, 3, 7, 0, 4, 1, 6]]
    check(x, 8, True, ties=True)
