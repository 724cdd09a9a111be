import math

import pytest
import torch

from kernels.rope import apply_rotary_emb_
from pipeline.models.config import ModelArchConfig
from pipeline.models.rope import RotaryEmbedding, compute_inv_freq
from tests.model_utils import tiny_config


pytestmark = pytest.mark.usefixtures("single_torch_thread")


ROPE_VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "default_theta": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 128,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "rope_theta": 10000.0,
    },
    "yarn_attention_factor_no_truncate": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 512,
        "attention_factor": 1.3,
        "truncate": False,
        "rope_theta": 1000000.0,
    },
}


def hf_inv_freq(cfg):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope_type = cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")


def ours(cfg):
    arch = ModelArchConfig.from_hf(cfg.to_dict())
    return compute_inv_freq(
        arch.rope_type, arch.rotary_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings
    )


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_inv_freq_and_attention_scaling_match_transformers(variant, head_dim):
    cfg = tiny_config("llama", head_dim=head_dim, rope_parameters=dict(ROPE_VARIANTS[variant]))
    ref_inv, ref_scaling = hf_inv_freq(cfg)
    inv, scaling = ours(cfg)
    assert inv.dtype == torch.float32 and inv.shape == ref_inv.shape
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scaling == pytest.approx(ref_scaling, rel=1e-12)


def test_yarn_implicit_factor_matches_transformers():
    cfg = tiny_config("llama", rope_parameters=dict(ROPE_VARIANTS["yarn"]))
    cfg.rope_parameters["factor"] = None  # factor = max_position_embeddings / original (deepseek style)
    ref_inv, ref_scaling = hf_inv_freq(cfg)
    arch = ModelArchConfig.from_hf(cfg.to_dict())
    assert "factor" not in arch.rope_scaling
    inv, scaling = ours(cfg)
    torch.testing.assert_close(inv, ref_inv, rtol=1e-6, atol=0)
    assert scaling == pytest.approx(ref_scaling) and scaling > 1.0


def test_partial_rotary_factor_matches_transformers():
    cfg = tiny_config("llama", head_dim=32, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    cfg.rope_parameters["partial_rotary_factor"] = 0.5
    ref_inv, _ = hf_inv_freq(cfg)
    arch = ModelArchConfig.from_hf(cfg.to_dict())
    assert arch.rotary_dim == 16
    inv, _ = ours(cfg)
    torch.testing.assert_close(inv, ref_inv, rtol=1e-6, atol=0)


@pytest.mark.parametrize("variant", ["default", "linear", "llama3", "yarn", "yarn_mscale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_matches_transformers(variant, dtype):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = tiny_config("llama", head_dim=32, rope_parameters=dict(ROPE_VARIANTS[variant]))
    arch = ModelArchConfig.from_hf(cfg.to_dict())
    gen = torch.Generator().manual_seed(0)
    T, H, KVH, D = 11, 4, 2, 32
    positions = torch.randint(0, arch.max_position_embeddings, (T,), generator=gen)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k = torch.randn(T, KVH, D, generator=gen).to(dtype)

    hf_rope = LlamaRotaryEmbedding(cfg)
    cos, sin = hf_rope(q, positions[None])  # [1, T, D] in q's dtype
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ref_q, ref_k = ref_q[0].transpose(0, 1), ref_k[0].transpose(0, 1)

    rope = RotaryEmbedding.from_arch(arch, dtype=dtype)
    out_q, out_k = rope(positions, q, k)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out_q, ref_q, **tol)
    torch.testing.assert_close(out_k, ref_k, **tol)
    assert not torch.equal(out_q, q)  # inputs are not modified; outputs are new tensors


def naive_rotate(x, positions, inv_freq, rotary_dim, neox, scaling=1.0):
    """Complex-number rotation: pair i is (x[i], x[i + rot/2]) for neox, (x[2i], x[2i+1]) for gptj."""
    half = rotary_dim // 2
    out = x.clone().double()
    ang = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, half]
    rot = torch.polar(torch.full_like(ang, scaling), ang)[:, None, :]
    xr = x[..., :rotary_dim].double()
    if neox:
        z = torch.complex(xr[..., :half], xr[..., half:]) * rot
        out[..., :half], out[..., half:rotary_dim] = z.real, z.imag
    else:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2]) * rot
        out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = z.real, z.imag
    return out


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16, 8])
def test_layouts_and_partial_rotation(neox, rotary_dim):
    gen = torch.Generator().manual_seed(1)
    T, D = 7, 32
    rope = RotaryEmbedding(D, rotary_dim, 256, 10000.0, "yarn",
                           {"factor": 2.0, "original_max_position_embeddings": 64}, is_neox_style=neox)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 255])
    q = torch.randn(T, 3, D, generator=gen)
    k = torch.randn(T, 1, D, generator=gen)
    out_q, out_k = rope(positions, q, k)
    for x, y in ((q, out_q), (k, out_k)):
        ref = naive_rotate(x, positions, rope.inv_freq, rotary_dim, neox, rope.attention_scaling)
        torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y[..., rotary_dim:], x[..., rotary_dim:], atol=0, rtol=0)


def test_in_place_rotation_on_a_strided_view():
    """The attention layer rotates q and k together inside the fused qkv output."""
    gen = torch.Generator().manual_seed(2)
    T, H, KVH, D = 5, 4, 2, 16
    rope = RotaryEmbedding(D, D, 64, 10000.0)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=gen)
    positions = torch.arange(3, 3 + T)
    q = qkv[:, : H * D].view(T, H, D).clone()
    k = qkv[:, H * D : (H + KVH) * D].view(T, KVH, D).clone()
    v = qkv[:, (H + KVH) * D :].clone()
    ref_q, ref_k = rope(positions, q, k)
    cos, sin = rope.cos_sin(positions)
    apply_rotary_emb_(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), cos, sin)
    torch.testing.assert_close(qkv[:, : H * D].view(T, H, D), ref_q, atol=0, rtol=0)
    torch.testing.assert_close(qkv[:, H * D : (H + KVH) * D].view(T, KVH, D), ref_k, atol=0, rtol=0)
    assert torch.equal(qkv[:, (H + KVH) * D :], v)


# --- config parsing of rope settings ---------------------------------------------------------------


def _base(**kw):
    d = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    d.update(kw)
    return d


def test_config_reads_transformers5_rope_parameters():
    arch = ModelArchConfig.from_hf(_base(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    assert (arch.rope_type, arch.rope_theta) == ("llama3", 500000.0)
    assert arch.rope_scaling == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}
    assert arch.head_dim == 16 and arch.rotary_dim == 16


@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_config_reads_legacy_rope_scaling(key):
    arch = ModelArchConfig.from_hf(_base(rope_theta=250000.0, rope_scaling={key: "linear", "factor": 2.0}))
    assert (arch.rope_type, arch.rope_theta, arch.rope_scaling) == ("linear", 250000.0, {"factor": 2.0})
    arch = ModelArchConfig.from_hf(_base(rope_theta=1e6, rope_scaling=None))
    assert (arch.rope_type, arch.rope_theta, arch.rope_scaling) == ("default", 1e6, {})
    arch = ModelArchConfig.from_hf(_base())
    assert (arch.rope_type, arch.rope_theta) == ("default", 10000.0)


def test_config_yarn_original_max_defaults_and_partial_factor():
    arch = ModelArchConfig.from_hf(_base(rope_scaling={"type": "yarn", "factor": 4.0}, partial_rotary_factor=0.5,
                                         head_dim=32))
    assert arch.rope_scaling["original_max_position_embeddings"] == 4096
    assert arch.rotary_dim == 16
    # phi3 style: a top-level original_max_position_embeddings wins
    arch = ModelArchConfig.from_hf(_base(original_max_position_embeddings=1024,
                                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}))
    assert arch.rope_scaling["original_max_position_embeddings"] == 1024


def test_unsupported_rope_type_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="longrope"):
        compute_inv_freq("longrope", 16, 1e4, {"short_factor": [1.0] * 8, "long_factor": [1.0] * 8})


def test_cos_sin_cache_matches_direct_computation():
    rope = RotaryEmbedding(16, 16, 1000, 10000.0)
    p = torch.tensor([999])
    cos, sin = rope.cos_sin(p)
    ang = 999 * rope.inv_freq
    assert cos.shape == (1, 1, 16)
    torch.testing.assert_close(cos[0, 0], torch.cat([ang.cos(), ang.cos()]))
    torch.testing.assert_close(sin[0, 0], torch.cat([-ang.sin(), ang.sin()]))
    assert math.isclose(rope.attention_scaling, 1.0)
