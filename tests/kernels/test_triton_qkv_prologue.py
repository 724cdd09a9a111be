"""The fused qkv prologue (q/k norm, rope, KV write) equals the unfused references."""
import pytest
import torch

from kernels.kv_cache import allocate_kv_cache
from kernels.triton_qkv_prologue import qkv_prologue_ref, qkv_prologue_triton
from pipeline.models.rope import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(t: int, h: int, kvh: int, d: int, rot: int, dtype: torch.dtype, norm: bool, neox: bool = True,
         seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    weights = [(1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) for _ in range(2)] if norm else [None, None]
    rope = RotaryEmbedding(d, rot, 4096, 10000.0, is_neox_style=neox, dtype=dtype, device=DEVICE)
    positions = torch.randint(0, 4000, (t,), generator=g).to(DEVICE)
    cos, sin = rope.cos_sin(positions)
    slots = torch.randperm(8 * 4, generator=g)[:t].to(DEVICE)
    if t > 1:
        slots[1] = -1  # a padding token writes nothing
    return qkv, q, k, v, weights, cos, sin, slots


def table_case(t: int, h: int, kvh: int, d: int, rot: int, dtype: torch.dtype, neox: bool, seed: int = 0):
    """``case``'s rope as the step's table and positions (``StepRope``)."""
    g = torch.Generator().manual_seed(seed)
    torch.randn(t, (h + 2 * kvh) * d, generator=g)
    [torch.randn(d, generator=g) for _ in range(2)]  # case's draws, so the positions are case's
    positions = torch.randint(0, 4000, (t,), generator=g).to(DEVICE)
    rope = RotaryEmbedding(d, rot, 4096, 10000.0, is_neox_style=neox, dtype=dtype, device=DEVICE)
    return rope.step_rope(positions)


@pytest.mark.parametrize("t,h,kvh,d,rot,norm", [(3, 4, 2, 16, 16, True), (2, 4, 4, 32, 16, True),
                                                 (4, 2, 1, 16, 16, False), (1, 8, 2, 64, 32, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
def test_prologue_equals_the_unfused_references(t, h, kvh, d, rot, norm, dtype, neox):
    results = []
    for fn in (qkv_prologue_ref, qkv_prologue_triton):
        qkv, q, k, v, (qw, kw), cos, sin, slots = case(t, h, kvh, d, rot, dtype, norm, neox)
        cache = allocate_kv_cache(1, 8, 4, kvh, d, dtype, DEVICE)[0]
        fn(q, k, v, qw, kw, 1e-6, cos, sin, neox, cache, slots)
        results.append((qkv.float(), cache.float()))
    (qkv_ref, cache_ref), (qkv_tri, cache_tri) = results
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(qkv_tri, qkv_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(cache_tri, cache_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("t,h,kvh,d,rot", [(3, 4, 2, 16, 16), (2, 4, 1, 32, 16)])
@pytest.mark.parametrize("neox", [True, False])
def test_table_rows_equal_gathered_rows(t, h, kvh, d, rot, neox):
    """cos/sin as the table and each token's row (read before the wait) give the bits of the gathered rows."""
    results = []
    for from_table in (False, True):
        qkv, q, k, v, (qw, kw), cos, sin, slots = case(t, h, kvh, d, rot, torch.bfloat16, True, neox)
        cache = allocate_kv_cache(1, 8, 4, kvh, d, torch.bfloat16, DEVICE)[0]
        if from_table:
            rope = table_case(t, h, kvh, d, rot, torch.bfloat16, neox)
            assert all(torch.equal(a, b) for a, b in zip(rope.gathered(), (cos, sin)))
            qkv_prologue_triton(q, k, v, qw, kw, 1e-6, rope.cos_table, rope.sin_table, neox, cache, slots,
                                rope.positions)
        else:
            qkv_prologue_triton(q, k, v, qw, kw, 1e-6, cos, sin, neox, cache, slots)
        results.append((qkv, cache))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_bad_shapes_are_refused():
    qkv, q, k, v, (qw, kw), cos, sin, slots = case(3, 4, 2, 16, 16, torch.float32, True)
    cache = allocate_kv_cache(1, 8, 4, 2, 16, torch.float32, DEVICE)[0]
    with pytest.raises(ValueError, match="together"):
        qkv_prologue_triton(q, k, v, qw, None, 1e-6, cos, sin, True, cache, slots)
    with pytest.raises(ValueError, match="slots"):
        qkv_prologue_triton(q, k, v, qw, kw, 1e-6, cos, sin, True, cache, slots[:2])
    with pytest.raises(ValueError, match="rows"):
        qkv_prologue_triton(q, k, v, qw, kw, 1e-6, cos, sin, True, cache, slots, slots[:2])
    with pytest.raises(ValueError, match="strides"):
        qkv_prologue_triton(q, k, v, qw, kw, 1e-6, cos, sin.contiguous()[:, :, :8], True, cache, slots)
