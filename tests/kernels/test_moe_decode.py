"""The grouping-free decode MoE kernels (``kernels/triton_moe_decode.py``) against ``fused_moe_ref``, and
``fused_moe``'s choice between them and the grouped-GEMM kernels.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on tiny shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels.moe as moe
from kernels.moe import fused_moe_ref
from kernels.triton_compat import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
H, I, E, K = 32, 48, 8, 2

needs_triton = pytest.mark.skipif(triton is None or DEVICE == "cpu" and not INTERPRET,
                                  reason="needs triton (GPU or TRITON_INTERPRET=1)")


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def routing(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k = 2: column 0 is expert 3 for every token (two tokens share an expert once T >= 2); column 1 is drawn from
    the other experts except 5, so expert 5 never receives a token."""
    gen = torch.Generator().manual_seed(seed)
    others = torch.tensor([0, 1, 2, 4, 6, 7])
    ids = torch.stack([torch.full((t,), 3), others[torch.randint(0, 6, (t,), generator=gen)]], dim=1)
    weights = torch.rand(t, 2, generator=gen) + 0.1
    return (weights / weights.sum(1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


def weights(n_experts: int = E, dtype: torch.dtype = torch.float32, seed: int = 1):
    w13 = randn(n_experts, 2 * I, H, dtype=dtype, seed=seed, scale=H**-0.5)
    w2 = randn(n_experts, H, I, dtype=dtype, seed=seed + 1, scale=I**-0.5)
    return w13, w2


@needs_triton
@pytest.mark.parametrize("t", [1, 2, 5])
# defaults; blocks smaller than I and H; gate/up tiles three stages ahead
@pytest.mark.parametrize("configs", [None, ((16, 16, 4), (16, 16, 2)), ((8, 16, 4, 3), (16, 16, 2))])
def test_decode_matches_ref(t, configs):
    from kernels.triton_moe_decode import fused_moe_decode_triton

    x = randn(t, H, seed=6)
    w13, w2 = weights()
    tw, ids = routing(t)
    kw = {} if configs is None else {"gate_up_config": configs[0], "down_config": configs[1]}
    y = fused_moe_decode_triton(x, w13, w2, tw, ids, **kw)
    assert y.dtype == x.dtype and y.shape == (t, H)
    torch.testing.assert_close(y, fused_moe_ref(x, w13, w2, tw, ids), atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("t", [1, 2, 5])
def test_decode_local_subset(t):
    """Experts [2, 6) on this rank (expert 5 empty, expert 3 chosen by every token, slots to 0, 1, 6, 7 dropped);
    the two ranks' partials add up to the full result."""
    from kernels.triton_moe_decode import fused_moe_decode_triton

    x = randn(t, H, seed=7)
    w13, w2 = weights()
    tw, ids = routing(t, seed=t)
    sub = fused_moe_decode_triton(x, w13[2:6].contiguous(), w2[2:6].contiguous(), tw, ids, 2, 4)
    torch.testing.assert_close(sub, fused_moe_ref(x, w13[2:6], w2[2:6], tw, ids, 2, 4), atol=1e-5, rtol=1e-5)
    parts = sum(fused_moe_decode_triton(x, w13[o:o + 4].contiguous(), w2[o:o + 4].contiguous(), tw, ids, o, 4)
                for o in (0, 4))
    torch.testing.assert_close(parts, fused_moe_ref(x, w13, w2, tw, ids), atol=1e-5, rtol=1e-5)


@needs_triton
def test_decode_no_local_slot_gives_zeros():
    from kernels.triton_moe_decode import fused_moe_decode_triton

    x = randn(2, H, seed=8)
    w13, w2 = weights(4)
    tw = torch.full((2, K), 0.5, device=DEVICE)
    ids = torch.tensor([[0, 1], [6, 7]], device=DEVICE)  # local experts are [4, 8): token 0 has none
    y = fused_moe_decode_triton(x, w13, w2, tw, ids, 4, 4)
    assert (y[0] == 0).all() and (y[1] != 0).any()
    torch.testing.assert_close(y, fused_moe_ref(x, w13, w2, tw, ids, 4, 4), atol=1e-5, rtol=1e-5)


@needs_triton
def test_decode_bf16_and_int32_ids():
    from kernels.triton_moe_decode import fused_moe_decode_triton

    x = randn(5, H, seed=9, dtype=torch.bfloat16)
    w13, w2 = weights(dtype=torch.bfloat16)
    tw, ids = routing(5)
    y = fused_moe_decode_triton(x, w13, w2, tw, ids.int())
    ref = fused_moe_ref(x, w13, w2, tw, ids)
    assert y.dtype == torch.bfloat16
    scale = ref.float().abs().max().item() + 1.0
    torch.testing.assert_close(y.float(), ref.float(), atol=4 * 2**-7 * scale, rtol=4 * 2**-7)


def test_decode_rejects_bad_inputs():
    from kernels.triton_moe_decode import fused_moe_decode_triton

    x = randn(2, H)
    w13, w2 = weights()
    tw, ids = routing(2)
    with pytest.raises(ValueError):
        fused_moe_decode_triton(x, w13, w2, tw, ids, 0, 4)
    with pytest.raises(ValueError):
        fused_moe_decode_triton(x, w13, w2, tw, ids, gate_up_config=(24, 16, 4))
    for bad in ((16, 16, 4, 0), (16, 16), (16, 16, 4, 2, 1)):
        with pytest.raises(ValueError, match="need"):
            fused_moe_decode_triton(x, w13, w2, tw, ids, gate_up_config=bad)
    with pytest.raises(ValueError, match="need"):  # stages are the gate/up kernel's only
        fused_moe_decode_triton(x, w13, w2, tw, ids, down_config=(16, 16, 2, 3))
    empty = fused_moe_decode_triton(x[:0], w13, w2, tw[:0], ids[:0])
    assert empty.shape == (0, H)


@pytest.mark.parametrize("t,expected", [(1, "decode"), (moe.DECODE_SLOTS // K, "decode"),
                                        (moe.DECODE_SLOTS // K + 1, "grouped")])
def test_fused_moe_dispatch_by_slot_count(monkeypatch, t, expected):
    """On the Triton path, ``T * k <= DECODE_SLOTS`` takes the decode kernels, larger batches the grouped GEMMs."""
    import kernels.dispatch
    import kernels.triton_moe
    import kernels.triton_moe_decode

    calls = []
    monkeypatch.setattr(kernels.dispatch, "use_triton", lambda device: True)
    monkeypatch.setattr(kernels.triton_moe_decode, "fused_moe_decode_triton",
                        lambda *a, **_: calls.append("decode") or fused_moe_ref(*a))
    monkeypatch.setattr(kernels.triton_moe, "fused_moe_triton", lambda *a: calls.append("grouped") or fused_moe_ref(*a))
    x = randn(t, H, seed=10)
    w13, w2 = weights()
    tw, ids = routing(t)
    torch.testing.assert_close(moe.fused_moe(x, w13, w2, tw, ids), fused_moe_ref(x, w13, w2, tw, ids))
    assert calls == [expected]


@pytest.mark.parametrize("top_k", [1, 2, 8, 9, 16, 24, 32])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 8, 14, 128])
def test_decode_config_down_tile_fits_the_register_budget(t, top_k):
    """The down kernel's [K_PAD, BLOCK_N, BLOCK_K] fp32 tile stays within DOWN_TILE_LIMIT elements a thread for any
    slot count (an 8-slot tile at 16 slots spilled and ran 10x slower), and sizes stay powers of two."""
    from kernels.triton_moe_decode import DOWN_TILE_LIMIT, decode_config

    gate_up, (bn, bk, warps) = decode_config(t, top_k)
    k_pad = triton.next_power_of_2(top_k)
    assert k_pad * bn * bk <= DOWN_TILE_LIMIT * 32 * warps
    assert all(v >= 1 and v & (v - 1) == 0 for v in (*gate_up[:3], bn, bk, warps))
    assert len(gate_up) == 3 or gate_up[3] >= 1  # gate/up's optional stages
    if top_k <= 8:  # the Qwen3-30B-A3B table is unchanged
        from kernels.triton_moe_decode import DECODE_CONFIGS

        assert (gate_up, (bn, bk, warps)) == next((g, d) for b, g, d in DECODE_CONFIGS[8] if t <= b)


@needs_triton
@pytest.mark.parametrize("t", [2, 5, 16])
def test_rows_as_decode_gives_each_token_its_one_token_bits(monkeypatch, t):
    """Under ``dispatch.rows_as_decode`` the decode kernels take one token's launch configs at any T, so every
    token of a verify row gets the bits a one-token step gives it (a 5-token step's own configs differ)."""
    import kernels.dispatch

    monkeypatch.setattr(kernels.dispatch, "use_triton", lambda device: True)
    x = randn(t, H, seed=12)
    w13, w2 = weights()
    tw, ids = routing(t, seed=3)
    with kernels.dispatch.rows_as_decode():
        y = moe.fused_moe(x, w13, w2, tw, ids)
    alone = torch.cat([moe.fused_moe(x[i:i + 1], w13, w2, tw[i:i + 1], ids[i:i + 1]) for i in range(t)])
    assert torch.equal(y, alone)
    torch.testing.assert_close(y, fused_moe_ref(x, w13, w2, tw, ids), atol=1e-5, rtol=1e-5)


def test_rows_as_decode_passes_one_tokens_configs(monkeypatch):
    """The dispatch itself (the interpreter's sums do not depend on the tile, so the test above cannot tell the
    configs apart on a CPU): one token's configs under ``rows_as_decode``, the table's own for T otherwise."""
    import kernels.dispatch
    import kernels.triton_moe_decode as decode

    seen = []
    monkeypatch.setattr(kernels.dispatch, "use_triton", lambda device: True)
    monkeypatch.setattr(decode, "fused_moe_decode_triton", lambda *a, **kw: seen.append(kw) or fused_moe_ref(*a))
    x = randn(5, H, seed=12)
    w13, w2 = weights()
    tw, ids = routing(5, seed=3)
    moe.fused_moe(x, w13, w2, tw, ids)
    with kernels.dispatch.rows_as_decode():
        moe.fused_moe(x, w13, w2, tw, ids)
    assert seen == [{"table_tokens": None}, {"table_tokens": 1}]
    assert decode.decode_config(5, K) != decode.decode_config(1, K)  # the configs differ at this T
