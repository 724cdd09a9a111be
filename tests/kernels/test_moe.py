"""Fused MoE: routing and reference against plain loops, the slot grouping's invariants, and the Triton kernels
against ``fused_moe_ref``.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on tiny shapes;
there the dots run in fp32 (the interpreter's 16-bit tl.dot is wrong).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from kernels.moe import fused_moe, fused_moe_ref, group_by_expert, route_topk_ref
from kernels.triton_compat import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
H, I, E, K = 32, 48, 8, 2


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def routing(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k = 2: column 0 is expert 3 for every token (one expert chosen by all tokens, > 16 of them at T = 17);
    column 1 is drawn from the other experts except 5, so expert 5 never receives a token."""
    gen = torch.Generator().manual_seed(seed)
    others = torch.tensor([0, 1, 2, 4, 6, 7])
    ids = torch.stack([torch.full((t,), 3), others[torch.randint(0, 6, (t,), generator=gen)]], dim=1)
    weights = torch.rand(t, 2, generator=gen) + 0.1
    return (weights / weights.sum(1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


def weights(n_experts: int = E, dtype: torch.dtype = torch.float32, seed: int = 1):
    w13 = randn(n_experts, 2 * I, H, dtype=dtype, seed=seed, scale=H**-0.5)
    w2 = randn(n_experts, H, I, dtype=dtype, seed=seed + 1, scale=I**-0.5)
    return w13, w2


def moe_loop(x, w13, w2, topk_weights, topk_ids, offset=0):
    """Per token, per chosen expert, in float64."""
    t, k = topk_ids.shape
    n = w13.shape[0]
    y = torch.zeros(t, x.shape[1], dtype=torch.float64)
    for i in range(t):
        for j in range(k):
            e = int(topk_ids[i, j]) - offset
            if not 0 <= e < n:
                continue
            xi = x[i].double().cpu()
            gate = w13[e, :I].double().cpu() @ xi
            up = w13[e, I:].double().cpu() @ xi
            y[i] += float(topk_weights[i, j]) * (w2[e].double().cpu() @ (F.silu(gate) * up))
    return y


# ---------------------------------------------------------------------------------------------- references


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_ref_against_loop(renormalize, dtype):
    logits = randn(7, E, seed=3, scale=2.0).to(dtype)
    w, ids = route_topk_ref(logits, 3, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (7, 3)
    for t in range(7):
        row = [float(v) for v in logits[t].float()]
        m = max(row)
        exps = [math.exp(v - m) for v in row]
        probs = [v / sum(exps) for v in exps]
        top = sorted(range(E), key=lambda e: -probs[e])[:3]
        if dtype == torch.float32:  # bf16 logits can tie; fp32 random ones do not
            assert ids[t].tolist() == top
        expected = [probs[e] for e in ids[t].tolist()]
        if renormalize:
            expected = [p / sum(expected) for p in expected]
        torch.testing.assert_close(w[t].cpu(), torch.tensor(expected), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("offset,n_local", [(0, E), (2, 4)])
def test_fused_moe_ref_against_loop(t, offset, n_local):
    x = randn(t, H, seed=4)
    w13, w2 = weights()
    tw, ids = routing(t)
    w13l, w2l = w13[offset:offset + n_local].contiguous(), w2[offset:offset + n_local].contiguous()
    y = fused_moe_ref(x, w13l, w2l, tw, ids, offset, n_local)
    assert y.dtype == x.dtype and y.shape == (t, H)
    torch.testing.assert_close(y.double().cpu(), moe_loop(x, w13l, w2l, tw, ids, offset), atol=1e-5, rtol=1e-5)


def test_fused_moe_ref_partials_sum_to_full_and_dtype():
    x = randn(6, H, seed=5)
    w13, w2 = weights()
    tw, ids = routing(6)
    full = fused_moe_ref(x, w13, w2, tw, ids)
    parts = [fused_moe_ref(x, w13[o:o + 4], w2[o:o + 4], tw, ids, o, 4) for o in (0, 4)]
    torch.testing.assert_close(parts[0] + parts[1], full, atol=1e-6, rtol=1e-5)
    yb = fused_moe_ref(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), tw, ids)
    assert yb.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        fused_moe_ref(x, w13, w2, tw, ids, 0, 4)


# ---------------------------------------------------------------------------------------------- grouping


@pytest.mark.parametrize("t,k,n_experts,block_m,offset", [
    (1, 2, 8, 16, 0), (17, 2, 8, 16, 0), (33, 4, 8, 4, 0), (40, 3, 6, 16, 2), (9, 2, 4, 1, 0), (0, 2, 4, 16, 0),
])
def test_group_by_expert_invariants(t, k, n_experts, block_m, offset):
    gen = torch.Generator().manual_seed(t + k)
    ids = torch.randint(0, n_experts + offset + 2, (t, k), generator=gen, dtype=torch.int32)  # some non-local
    if t:
        ids[:, 0] = offset  # one expert chosen by every token
    n_slots = t * k
    slots, block_expert, num_padded = group_by_expert(ids, n_experts, block_m, offset)
    p = n_slots + n_experts * (block_m - 1)
    assert slots.dtype == block_expert.dtype == num_padded.dtype == torch.int32
    assert slots.shape == (p,) and block_expert.shape == (p // block_m,) and num_padded.dim() == 0
    npad = int(num_padded)
    assert npad % block_m == 0 and npad <= (p // block_m) * block_m
    flat = ids.reshape(-1).long() - offset
    local = (flat >= 0) & (flat < n_experts)
    # every local slot exactly once, non-local slots never, everything else the sentinel
    real = slots[slots != n_slots]
    assert sorted(real.tolist()) == torch.nonzero(local).squeeze(1).tolist()
    assert (slots[npad:] == n_slots).all()
    # blocks are single-expert, in expert order, ceil(count / block_m) of them (none for an expert without
    # tokens), nothing after num_padded
    counts = torch.bincount(flat[local], minlength=n_experts)
    assert (block_expert[npad // block_m:] == -1).all()
    used = block_expert[: npad // block_m].long()
    assert (used >= 0).all() and (used[1:] >= used[:-1]).all()
    assert torch.bincount(used, minlength=n_experts).tolist() == [
        (c + block_m - 1) // block_m for c in counts.tolist()]
    for b, e in enumerate(used.tolist()):
        chunk = slots[b * block_m:(b + 1) * block_m].long()
        chunk = chunk[chunk != n_slots]
        assert (flat[chunk] == e).all()


# ---------------------------------------------------------------------------------------------- Triton

needs_triton = pytest.mark.skipif(triton is None or DEVICE == "cpu" and not INTERPRET,
                                  reason="needs triton (GPU or TRITON_INTERPRET=1)")


@needs_triton
@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("block_m", [None, 64])
def test_fused_moe_triton_matches_ref(t, block_m):
    from kernels.triton_moe import GroupedConfig, fused_moe_triton

    x = randn(t, H, seed=6)
    w13, w2 = weights()
    tw, ids = routing(t)
    config = None if block_m is None else GroupedConfig(block_m, (16, 32, 4, 2), (32, 16, 2, 3))
    y = fused_moe_triton(x, w13, w2, tw, ids, config=config)
    ref = fused_moe_ref(x, w13, w2, tw, ids)
    assert y.dtype == x.dtype and y.shape == (t, H)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("t", [3, 17])
def test_fused_moe_triton_local_subset(t):
    """Experts [2, 6) on this rank (expert 5 empty, expert 3 chosen by every token); ranks' partials add up."""
    from kernels.triton_moe import fused_moe_triton

    x = randn(t, H, seed=7)
    w13, w2 = weights()
    tw, ids = routing(t, seed=t)
    sub = fused_moe_triton(x, w13[2:6].contiguous(), w2[2:6].contiguous(), tw, ids, 2, 4)
    torch.testing.assert_close(sub, fused_moe_ref(x, w13[2:6], w2[2:6], tw, ids, 2, 4), atol=1e-5, rtol=1e-5)
    parts = sum(fused_moe_triton(x, w13[o:o + 4].contiguous(), w2[o:o + 4].contiguous(), tw, ids, o, 4)
                for o in (0, 4))
    torch.testing.assert_close(parts, fused_moe_ref(x, w13, w2, tw, ids), atol=1e-5, rtol=1e-5)


@needs_triton
def test_fused_moe_triton_bf16_and_int32_ids():
    from kernels.triton_moe import fused_moe_triton

    x = randn(5, H, seed=8, dtype=torch.bfloat16)
    w13, w2 = weights(dtype=torch.bfloat16)
    tw, ids = routing(5)
    y = fused_moe_triton(x, w13, w2, tw, ids.int())
    ref = fused_moe_ref(x, w13, w2, tw, ids)
    assert y.dtype == torch.bfloat16
    scale = ref.float().abs().max().item() + 1.0
    torch.testing.assert_close(y.float(), ref.float(), atol=4 * 2**-7 * scale, rtol=4 * 2**-7)


def test_fused_moe_entry_point_uses_reference_off_cuda():
    x = randn(4, H, seed=9).cpu()
    w13, w2 = (w.cpu() for w in weights())
    tw, ids = (v.cpu() for v in routing(4))
    torch.testing.assert_close(fused_moe(x, w13, w2, tw, ids), fused_moe_ref(x, w13, w2, tw, ids))
