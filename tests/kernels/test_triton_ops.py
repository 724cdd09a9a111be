"""Triton per-layer ops (RMSNorm, rope, SiLU-and-mul, KV write) against their torch references.

On CPU the kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1); there bf16 casts
truncate instead of rounding to nearest, so bf16 is compared within two ulps. Without the interpreter (a CUDA
machine, e.g. ``pytest --noconftest``) the same tests run on the GPU, plus the ``gpu``-marked ones.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import dispatch
from kernels.kv_cache import write_kv_ref
from kernels.triton_activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.triton_kv_cache import write_kv_padded_ref, write_kv_triton
from kernels.triton_norm import rms_norm_ref, rms_norm_triton
from kernels.triton_rope import apply_rotary_ref_, apply_rotary_triton_
from pipeline.models.rope import RotaryEmbedding

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
DTYPES = [torch.float32, torch.bfloat16]


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = 1e-5 if expected.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("hidden", [576, 96])
def test_rms_norm(dtype, tokens, hidden):
    x, res = randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype, seed=1)
    weight = randn(hidden, dtype=dtype, seed=2, scale=0.5) + 1
    close(rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    x_before, res_before = x.clone(), res.clone()
    out, new_res = rms_norm_triton(x, weight, 1e-5, residual=res)
    ref_out, ref_res = rms_norm_ref(x, weight, 1e-5, residual=res)
    assert out.dtype == new_res.dtype == dtype and out.shape == new_res.shape == x.shape
    close(new_res, ref_res)
    close(out, ref_out)
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs must not be modified"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_views(dtype):
    """q/k norm: [T, heads, D] strided views into a fused qkv output, and 4-D / non-contiguous inputs."""
    tokens, heads, kv_heads, head_dim = 3, 5, 2, 96
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    weight = randn(head_dim, dtype=dtype, seed=3, scale=0.5) + 1
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    for view in (q, k, q.unsqueeze(0).expand(2, -1, -1, -1), q.transpose(0, 1)):
        out = rms_norm_triton(view, weight, 1e-6)
        assert out.shape == view.shape
        close(out, rms_norm_ref(view, weight, 1e-6))
    out, new_res = rms_norm_triton(q, weight, 1e-6, residual=k[:, :1].expand(-1, heads, -1))
    ref_out, ref_res = rms_norm_ref(q, weight, 1e-6, residual=k[:, :1].expand(-1, heads, -1))
    close(out, ref_out)
    close(new_res, ref_res)


def _qkv_views(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    tokens = qkv.shape[0]
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [96, 48], ids=["full", "partial"])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_rope(dtype, neox, rotary_dim, tokens):
    heads, kv_heads, head_dim = 5, 2, 96
    rope = RotaryEmbedding(head_dim, rotary_dim, 64, 10000.0, is_neox_style=neox, dtype=dtype, device=DEVICE)
    positions = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    cos, sin = rope.cos_sin(positions)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    expected = qkv.clone()
    apply_rotary_triton_(*_qkv_views(qkv, heads, kv_heads, head_dim), cos, sin, neox)
    apply_rotary_ref_(*_qkv_views(expected, heads, kv_heads, head_dim), cos, sin, neox)
    close(qkv, expected)
    untouched = qkv.view(tokens, heads + 2 * kv_heads, head_dim)[..., rotary_dim:]
    assert torch.equal(untouched, expected.view_as(qkv.view(tokens, -1, head_dim))[..., rotary_dim:])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], expected[:, (heads + kv_heads) * head_dim :])


def test_rope_q_only_combined_view():
    """k=None rotates one [T, H + KVH, D] q|k view, as the model does without q/k norm."""
    tokens, heads, head_dim = 3, 6, 64
    rope = RotaryEmbedding(head_dim, head_dim, 32, 10000.0, device=DEVICE)
    cos, sin = rope.cos_sin(torch.tensor([0, 7, 31], device=DEVICE))
    qk = randn(tokens, heads, head_dim)
    expected = qk.clone()
    apply_rotary_triton_(qk, None, cos, sin, True)
    apply_rotary_ref_(expected, None, cos, sin, True)
    close(qk, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("inter", [96, 576, 1000])
def test_silu_and_mul(dtype, tokens, inter):
    gate_up = randn(tokens, 2 * inter, dtype=dtype, scale=4.0)
    out = silu_and_mul_triton(gate_up)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    close(out, silu_and_mul_ref(gate_up))


def test_silu_and_mul_extremes_and_views():
    wide = randn(4, 3 * 96)
    wide[0, :96] = torch.tensor([-1000.0, 1000.0, -88.0, 88.0, 0.0] * 19 + [-1e30], device=DEVICE)
    gate_up = wide[:, : 2 * 96]  # strided rows
    out = silu_and_mul_triton(gate_up)
    assert torch.isfinite(out).all()
    close(out, silu_and_mul_ref(gate_up))
    batched = randn(2, 3, 2 * 40)
    close(silu_and_mul_triton(batched), silu_and_mul_ref(batched))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_write_kv_strided_and_padded(dtype, block_size, tokens):
    num_blocks, kv_heads, head_dim, heads = 24, 3, 96, 4
    gen = torch.Generator().manual_seed(tokens)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1  # padding tokens (CUDA-graph batch padding)
    slots = slots.to(DEVICE)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    expected = cache.clone()
    write_kv_triton(key, value, cache, slots)
    write_kv_padded_ref(key, value, expected, slots)
    assert torch.equal(cache, expected)
    flat = cache.view(2, -1, kv_heads, head_dim)
    valid = slots >= 0
    assert torch.equal(flat[0, slots[valid]], key[valid]) and torch.equal(flat[1, slots[valid]], value[valid])
    written = torch.zeros(flat.shape[1], dtype=torch.bool, device=DEVICE)
    written[slots[valid]] = True
    assert (flat[:, ~written] == 7).all(), "other slots (and padding) must stay untouched"


def test_write_kv_padded_ref_agrees_with_ref():
    key, value = randn(5, 2, 8), randn(5, 2, 8, seed=1)
    slots = torch.tensor([4, 0, 9, 3, 11], device=DEVICE)
    a = torch.zeros(2, 3, 4, 2, 8, device=DEVICE)
    b = a.clone()
    write_kv_ref(key, value, a, slots)
    write_kv_padded_ref(key, value, b, slots)
    assert torch.equal(a, b)
    write_kv_padded_ref(key, value, b, torch.full((5,), -1, device=DEVICE))
    write_kv_triton(key, value, b, torch.full((5,), -1, device=DEVICE))
    assert torch.equal(a, b), "all-padding writes nothing"


def test_dispatch_uses_references_on_cpu(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("Triton path taken on CPU")

    for name in ("rms_norm_triton", "apply_rotary_triton_", "silu_and_mul_triton", "write_kv_triton"):
        monkeypatch.setattr(dispatch, name, boom)
    x, w = torch.randn(3, 96), torch.randn(96)
    assert torch.equal(dispatch.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    q, k = torch.randn(3, 4, 32), torch.randn(3, 2, 32)
    cos, sin = RotaryEmbedding(32, 32, 8, 10000.0).cos_sin(torch.tensor([1, 2, 3]))
    q2, k2 = q.clone(), k.clone()
    dispatch.apply_rotary_(q, k, cos, sin, True)
    apply_rotary_ref_(q2, k2, cos, sin, True)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    assert torch.equal(dispatch.silu_and_mul(x), silu_and_mul_ref(x))
    cache = torch.zeros(2, 2, 2, 2, 32)
    dispatch.write_kv(k, k, cache, torch.tensor([3, -1, 0]))
    assert torch.equal(cache[0, 1, 1], k[0]) and torch.equal(cache[1, 0, 0], k[2])
    assert not cache[:, 0, 1].any() and not cache[:, 1, 0].any()


def test_use_triton_switch(monkeypatch):
    assert not dispatch.use_triton(torch.device("cpu"))
    assert dispatch.use_triton(torch.device("cuda", 0)) == dispatch.triton_available()
    monkeypatch.setenv("CONVEYOR_DISABLE_TRITON", "1")
    assert not dispatch.use_triton(torch.device("cuda"))


def test_dispatch_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kernels import dispatch\n"
        "assert not dispatch.triton_available() and not dispatch.use_triton(torch.device('cuda'))\n"
        "x = torch.randn(2, 8); print(dispatch.rms_norm(x, torch.ones(8), 1e-6).shape)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# ---- CUDA only: model-sized bf16 shapes, bit-exact where the math allows, and CUDA-graph capture ----


def _ulps_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 outputs rounded once (kernel) vs rounded twice (torch): within one bf16 ulp plus fp32 slack."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=8e-3, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 77, 2048])
def test_gpu_rms_norm_bf16(tokens):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, 4096, device="cuda", generator=gen).bfloat16()
    res = torch.randn(tokens, 4096, device="cuda", generator=gen).bfloat16()
    weight = (torch.rand(4096, device="cuda", generator=gen) + 0.5).bfloat16()
    out, new_res = rms_norm_triton(x, weight, 1e-5, res)
    ref_out, ref_res = rms_norm_ref(x, weight, 1e-5, res)
    assert torch.equal(new_res, ref_res), "the residual add rounds exactly like torch"
    _ulps_close(out, ref_out)
    qkv = torch.randn(tokens, 48 * 128, device="cuda", generator=gen).bfloat16()
    q = qkv[:, : 32 * 128].view(tokens, 32, 128)
    _ulps_close(rms_norm_triton(q, weight[:128], 1e-6), rms_norm_ref(q, weight[:128], 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [128, 64], ids=["full", "partial"])
def test_gpu_rope_bf16(neox, rotary_dim):
    tokens, heads, kv_heads, head_dim = 513, 32, 8, 128
    rope = RotaryEmbedding(head_dim, rotary_dim, 8192, 500000.0, is_neox_style=neox, dtype=torch.bfloat16,
                           device="cuda")
    cos, sin = rope.cos_sin(torch.randint(0, 8192, (tokens,), device="cuda"))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda").bfloat16()
    expected = qkv.clone()
    apply_rotary_triton_(*_qkv_views(qkv, heads, kv_heads, head_dim), cos, sin, neox)
    apply_rotary_ref_(*_qkv_views(expected, heads, kv_heads, head_dim), cos, sin, neox)
    _ulps_close(qkv, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300])
def test_gpu_silu_and_mul_bf16(tokens):
    gate_up = (torch.randn(tokens, 2 * 14336, device="cuda") * 3).bfloat16()
    _ulps_close(silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up))


@pytest.mark.gpu
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float32])
def test_gpu_write_kv_bf16(key_dtype):
    tokens, heads, kv_heads, head_dim, block_size = 1000, 32, 8, 128, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda").to(key_dtype)
    key, value = (qkv[:, (heads + i * kv_heads) * head_dim :][:, : kv_heads * head_dim].view(tokens, kv_heads, -1)
                  for i in (0, 1))
    slots = torch.randperm(4096 * block_size, device="cuda")[:tokens]
    slots[-100:] = -1
    cache = torch.zeros(2, 4096, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    expected = cache.clone()
    write_kv_triton(key, value, cache, slots)
    write_kv_padded_ref(key, value, expected, slots)
    assert torch.equal(cache, expected)


@pytest.mark.gpu
def test_gpu_ops_capture_in_cuda_graph():
    """No host syncs or allocations that break capture: all four ops replay in a CUDA graph."""
    tokens, hidden, heads, kv_heads, head_dim = 8, 1024, 8, 2, 128
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    res, weight = torch.randn_like(x), torch.ones(hidden, device="cuda").bfloat16()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda").bfloat16()
    q, k = _qkv_views(qkv, heads, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    cos, sin = RotaryEmbedding(head_dim, head_dim, 64, 10000.0, dtype=torch.bfloat16,
                               device="cuda").cos_sin(torch.arange(tokens, device="cuda"))
    cache = torch.zeros(2, 4, 16, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([0, 1, 2, 17, 33, -1, -1, -1], device="cuda")
    gate_up = torch.randn(tokens, 2 * 512, device="cuda").bfloat16()

    def step():
        out, new_res = rms_norm_triton(x, weight, 1e-6, res)
        apply_rotary_triton_(q, k, cos, sin, True)
        write_kv_triton(k, v, cache, slots)
        return out, new_res, silu_and_mul_triton(gate_up)

    qkv0 = qkv.clone()
    step()  # compile outside capture
    qkv.copy_(qkv0)
    cache.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    qkv.copy_(qkv0)
    cache.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref_q, ref_k = (t.clone() for t in _qkv_views(qkv0, heads, kv_heads, head_dim))
    apply_rotary_ref_(ref_q, ref_k, cos, sin, True)
    _ulps_close(q, ref_q)
    _ulps_close(outs[2], silu_and_mul_ref(gate_up))
    assert torch.equal(outs[1], x + res)
    assert torch.equal(cache[0, 2, 1], k[4]) and not cache[:, 3].any()
