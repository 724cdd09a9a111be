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


def test_bad_shapes_are_refused():
    qkv, q, k, v, (qw, kw), cos, sin, slots = case(3, 4, 2, 16, 16, torch.float32, True)
    cache = allocate_kv_cache(1, 8, 4, 2, 16, torch.float32, DEVICE)[0]
    with pytest.raises(ValueError, match="together"):
        qkv_prologue_triton(q, k, v, qw, None, 1e-6, cos, sin, True, cache, slots)
    with pytest.raises(ValueError, match="slots"):
        qkv_prologue_triton(q, k, v, qw, kw, 1e-6, cos, sin, True, cache, slots[:2])
