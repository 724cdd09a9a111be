"""The decode MoE kernels routing from the router's logits themselves (``fused_moe_decode_routed_triton``) against
the routing kernel followed by the same kernels, and ``fused_moe_routed``'s choice of path.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on tiny shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels.moe as moe
from kernels.moe import fused_moe_ref, route_topk_ref
from kernels.triton_compat import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
H, I = 32, 48

needs_triton = pytest.mark.skipif(triton is None or DEVICE == "cpu" and not INTERPRET,
                                  reason="needs triton (GPU or TRITON_INTERPRET=1)")


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def experts(n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(n, 2 * I, H, seed=1, scale=H**-0.5, dtype=dtype), randn(n, H, I, seed=2, scale=I**-0.5, dtype=dtype)


def logits_with_ties(t: int, columns: int, seed: int) -> torch.Tensor:
    """Random logits where token 0's two best experts tie (the lower id goes first), token 1's second and third
    tie (the tie decides the second slot), with a -0.0 and a +0.0 beside them, and the last token's logits are
    all negative."""
    z = randn(t, columns, seed=seed)
    z[0, 1] = z[0, 4] = z[0].max() + 1.0
    if t > 1:
        top = z[1].max()
        z[1, 0], z[1, 2], z[1, 4] = top + 1.0, top + 0.5, top + 0.5
        z[1, 1], z[1, 3] = -0.0, 0.0
    if t > 2:
        z[-1] = -z[-1].abs() - 0.5
    return z


@needs_triton
@pytest.mark.parametrize("t", [1, 2, 5])
@pytest.mark.parametrize("e,k,shared,renormalize", [(8, 2, False, True), (8, 2, False, False), (12, 3, True, True),
                                                    (16, 4, True, False), (5, 5, False, True)])
def test_routed_kernels_equal_routing_kernel_then_kernels(t, e, k, shared, renormalize):
    """The same ids as the routing kernel (ties to the lower id; a non-power-of-two expert count; every expert
    chosen), so the same output within the weights' last bit; and, on logits without ties (``torch.topk`` orders
    ties as it likes), the torch reference's."""
    from kernels.triton_moe_decode import LogitsRouting, fused_moe_decode_routed_triton, fused_moe_decode_triton
    from kernels.triton_moe_routing import route_topk_triton

    w13, w2 = experts(e + shared)
    x = randn(t, H, seed=3)
    logits = logits_with_ties(t, e + shared, seed=4)
    sid = e if shared else None
    tw, ids = route_topk_triton(logits, k, renormalize, sid)
    routed = fused_moe_decode_routed_triton(x, w13, w2, LogitsRouting(logits, k, renormalize, sid))
    torch.testing.assert_close(routed, fused_moe_decode_triton(x, w13, w2, tw, ids), atol=1e-6, rtol=1e-6)
    distinct = randn(t, e + shared, seed=5)
    routed = fused_moe_decode_routed_triton(x, w13, w2, LogitsRouting(distinct, k, renormalize, sid))
    ref = fused_moe_ref(x, w13, w2, *route_topk_ref(distinct, k, renormalize, sid))
    torch.testing.assert_close(routed, ref, atol=1e-5, rtol=1e-5)


@needs_triton
def test_routed_kernels_each_slot_gets_its_ranked_expert():
    """Experts whose outputs cannot be confused (expert i's down rows put 1 in column i only, the gate/up rows make
    every activation positive): the output's column i is the weight the routing gives expert i."""
    from kernels.triton_moe_decode import LogitsRouting, fused_moe_decode_routed_triton

    e, k = 8, 3
    w13 = torch.zeros(e, 2 * I, H, device=DEVICE)
    w13[:, :, 0] = 4.0  # gate and up both 4 * x[0]: silu(4) * 4 for x[0] = 1
    w2 = torch.zeros(e, H, I, device=DEVICE)
    for i in range(e):
        w2[i, i, 0] = 1.0
    x = torch.zeros(2, H, device=DEVICE)
    x[:, 0] = 1.0
    logits = torch.tensor([[0.0, 3.0, 1.0, 5.0, 2.0, 5.0, -1.0, 0.5],
                           [7.0, -2.0, -2.0, 6.0, -2.0, 1.0, 0.0, 6.5]], device=DEVICE)
    y = fused_moe_decode_routed_triton(x, w13, w2, LogitsRouting(logits, k, True))
    unit = torch.nn.functional.silu(torch.tensor(4.0)) * 4.0
    tw, ids = route_topk_ref(logits, k, True)
    expected = torch.zeros(2, H)
    expected.scatter_(1, ids.cpu(), tw.cpu() * unit)
    assert [sorted(row) for row in ids.tolist()] == [[1, 3, 5], [0, 3, 7]]  # the tie at 5.0 picks both
    torch.testing.assert_close(y.cpu(), expected, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("t", [1, 3])
def test_routed_kernels_local_experts_and_folded_shared(t):
    """Expert parallelism: each block computes its local experts' share (the folded shared expert on the block
    holding the last routed expert) and the shares sum to the whole."""
    from kernels.triton_moe_decode import LogitsRouting, fused_moe_decode_routed_triton

    e, k = 8, 2
    w13, w2 = experts(e + 1)
    x = randn(t, H, seed=5)
    logits = logits_with_ties(t, e + 1, seed=6)
    routing = LogitsRouting(logits, k, True, e)
    whole = fused_moe_decode_routed_triton(x, w13, w2, routing)
    first = fused_moe_decode_routed_triton(x, w13[:3].contiguous(), w2[:3].contiguous(), routing, 0, 3)
    rest = fused_moe_decode_routed_triton(x, w13[3:].contiguous(), w2[3:].contiguous(), routing, 3, 6)
    torch.testing.assert_close(first + rest, whole, atol=1e-5, rtol=1e-5)


@needs_triton
def test_routed_kernels_bf16_and_strided_logits():
    """bf16 activations and logits, the logits a column slice of a wider router output (the padded router rows)."""
    from kernels.triton_moe_decode import LogitsRouting, fused_moe_decode_routed_triton, fused_moe_decode_triton
    from kernels.triton_moe_routing import route_topk_triton

    e, k, t = 8, 2, 2
    w13, w2 = experts(e, torch.bfloat16)
    x = randn(t, H, seed=7, dtype=torch.bfloat16)
    logits = randn(t, 16, seed=8, dtype=torch.bfloat16)[:, :e]
    tw, ids = route_topk_triton(logits, k, True)
    y = fused_moe_decode_routed_triton(x, w13, w2, LogitsRouting(logits, k, True))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, fused_moe_decode_triton(x, w13, w2, tw, ids), atol=1e-2, rtol=1e-2)


@needs_triton
def test_routed_kernels_reject_bad_inputs():
    from kernels.triton_moe_decode import LogitsRouting, fused_moe_decode_routed_triton

    w13, w2 = experts(8)
    x = randn(2, H, seed=9)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe_decode_routed_triton(x, w13, w2, LogitsRouting(randn(2, 8, seed=1), 9, True))
    with pytest.raises(ValueError, match="do not match"):
        fused_moe_decode_routed_triton(x, w13, w2, LogitsRouting(randn(3, 8, seed=1), 2, True))
    with pytest.raises(ValueError, match="router logits"):
        fused_moe_decode_routed_triton(x, w13, w2, LogitsRouting(randn(2, 8, seed=1).long(), 2, True))


@pytest.mark.parametrize("t,e,switch,expected", [
    (1, 8, True, "routed"), (moe.DECODE_SLOTS // 2, 8, True, "routed"), (moe.DECODE_SLOTS // 2 + 1, 8, True, "grouped"),
    (1, 8, False, "decode"), (1, moe.ROUTE_IN_EXPERTS_MAX + 1, True, "decode")])
def test_fused_moe_routed_path(monkeypatch, t, e, switch, expected):
    """The kernels route themselves exactly where the decode kernels run, the switch is on and the experts are
    few enough; elsewhere the routing kernel runs first. On CPU without Triton: the references."""
    import kernels.dispatch as dispatch
    import kernels.triton_moe as grouped
    import kernels.triton_moe_decode as decode

    calls: list[str] = []
    monkeypatch.setattr(dispatch, "use_triton", lambda device: True)
    monkeypatch.setattr(moe, "ROUTE_IN_EXPERTS", switch)
    monkeypatch.setattr(moe, "route_topk", lambda *a: calls.append("route") or route_topk_ref(*a))
    monkeypatch.setattr(decode, "fused_moe_decode_routed_triton", lambda *a, **kw: calls.append("routed"))
    monkeypatch.setattr(decode, "fused_moe_decode_triton", lambda *a, **kw: calls.append("decode"))
    monkeypatch.setattr(grouped, "fused_moe_triton", lambda *a, **kw: calls.append("grouped"))
    moe.fused_moe_routed(torch.zeros(t, H), torch.zeros(t, e), torch.zeros(e, 2 * I, H), torch.zeros(e, H, I), 2,
                         True)
    assert calls == ([expected] if expected == "routed" else ["route", expected])


def test_fused_moe_routed_reference_on_cpu(monkeypatch):
    import kernels.dispatch as dispatch

    monkeypatch.setattr(dispatch, "use_triton", lambda device: False)
    w13, w2 = (w.cpu() for w in experts(9))
    x, logits = randn(3, H, seed=10).cpu(), randn(3, 9, seed=11).cpu()
    y = moe.fused_moe_routed(x, logits, w13, w2, 2, False, 8)
    torch.testing.assert_close(y, fused_moe_ref(x, w13, w2, *route_topk_ref(logits, 2, False, 8)))
