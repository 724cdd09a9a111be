"""FP8 checkpoints as users download them, through the loader's weight stream (pipeline/models/quantized_weights.py):
tiny random Llama, Qwen3, Qwen3-MoE and Qwen3.5-MoE checkpoints rewritten in the official block-FP8 layout (hidden
sizes 160 / 200, so blocks are partial; bf16 and fp32 scales; experts one tensor each; routers and Gated DeltaNet
parameters unquantized) and as compressed-tensors FP8 (channel and tensor scales): logits and greedy tokens equal
transformers' on the same model with each weight replaced by its dequantized value (fp32). The same for
--quantization fp8 against the quantize-dequantize reference, and for dummy weights; the checkpoint's KV scales reach
the attention layers."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from pipeline.models.config import ModelArchConfig
from pipeline.models.loader import load_hf_config
from pipeline.models.quantized_weights import apply_kv_scales, checkpoint_weights
from pipeline.models.registry import build_model
from tests.fp8_checkpoints import (dequantized_reference, fake_block_fp8, online_fp8_weights, to_block_fp8,
                                   to_compressed_tensors)
from tests.model_utils import hf_greedy, run_paged

pytestmark = pytest.mark.usefixtures("single_torch_thread")

NEW_TOKENS = 12
SHAPES = {"llama": dict(hidden_size=160, intermediate_size=200), "qwen3": dict(hidden_size=200, intermediate_size=160),
          "qwen3_moe": dict(hidden_size=200), "qwen3_5_moe_text": dict(hidden_size=200)}
TOLERANCE = {"qwen3_5_moe_text": 2e-3}  # the hybrid's chunked delta rule sums in another order than transformers'


def prompt(n: int = 40, seed: int = 0) -> list[int]:
    return torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def load(directory, quantization: str | None = None, dtype: torch.dtype = torch.float32, build: bool = True):
    """The model as the engine loads it: the checkpoint's weight stream, then its KV scales (``build`` False: the
    stream alone)."""
    hf_config = load_hf_config(str(directory))
    weights = checkpoint_weights(str(directory), hf_config, quantization, dtype, torch.device("cpu"))
    if not build:
        return None, weights
    return build_model(ModelArchConfig.from_hf(hf_config), weights, dtype,
                       after_weights=lambda model: apply_kv_scales(model, weights.kv_scales)), weights


def tensors(directory) -> dict[str, torch.Tensor]:
    with safe_open(directory / "model.safetensors", framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def assert_matches(model, reference, model_type: str) -> None:
    ids = prompt()
    ref_logits, ref_tokens, _ = hf_greedy(reference, ids, NEW_TOKENS)
    run = run_paged(model, [ids], NEW_TOKENS, chunks=[16, 24])
    atol = TOLERANCE.get(model_type, 1e-4)
    torch.testing.assert_close(run.prompt_logits[0], ref_logits, atol=atol, rtol=1e-3)
    assert run.generated[0] == ref_tokens


@pytest.mark.parametrize("model_type,scale_dtype", [
    ("llama", torch.bfloat16), ("qwen3", torch.bfloat16), ("qwen3", torch.float32), ("qwen3_moe", torch.bfloat16),
    ("qwen3_5_moe_text", torch.bfloat16), ("qwen3_5_moe_text", torch.float32)])
def test_block_fp8_checkpoint_equals_dequantized_transformers(make_model_dir, tmp_path, model_type, scale_dtype):
    directory = make_model_dir(model_type, seed=2, **SHAPES[model_type])
    original = tensors(directory)
    dequantized = to_block_fp8(directory, scale_dtype)
    stored = tensors(directory)
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())
    assert any(name.endswith("weight_scale_inv") and t.dtype == scale_dtype and t.shape[-1] == 2
               for name, t in stored.items())  # 160 / 200 wide: a full block and a partial one
    assert all((dequantized[name] - original[name]).abs().max() > 0 for name in dequantized)  # really rounded
    model, _ = load(directory)
    assert_matches(model, dequantized_reference(directory, dequantized, tmp_path / "reference"), model_type)
    # what the checkpoint kept unquantized loads as it is: the routers, the shared expert's gate, GDN parameters
    _, stream = load(directory, build=False)
    streamed = dict(stream)
    assert set(streamed) == set(original)
    kept = [name for name in original if name not in dequantized]
    assert all(torch.equal(streamed[name], original[name]) for name in kept)
    if model_type in ("qwen3_moe", "qwen3_5_moe_text"):
        assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.0.up_proj.weight"} & set(dequantized) \
            == {"model.layers.0.mlp.experts.0.up_proj.weight"}
    if model_type == "qwen3_5_moe_text":
        assert {"model.layers.0.linear_attn.in_proj_b.weight", "model.layers.0.linear_attn.A_log",
                "model.layers.0.mlp.shared_expert_gate.weight"} <= set(kept)


@pytest.mark.parametrize("model_type,strategy", [("qwen3", "channel"), ("qwen3", "tensor"),
                                                 ("qwen3_moe", "channel"), ("qwen3_5_moe_text", "tensor")])
def test_compressed_tensors_fp8_equals_dequantized_transformers(make_model_dir, tmp_path, model_type, strategy):
    directory = make_model_dir(model_type, seed=3, **SHAPES[model_type])
    dequantized = to_compressed_tensors(directory, strategy)
    model, weights = load(directory)
    assert weights.scheme is not None and weights.scheme.strategy == strategy
    assert_matches(model, dequantized_reference(directory, dequantized, tmp_path / "reference"), model_type)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_moe_text"])
def test_online_fp8_equals_quantize_dequantize_reference(make_model_dir, tmp_path, model_type):
    """--quantization fp8 on a float32 checkpoint: the model computes with the FP8-rounded projections, the modules
    the official checkpoints keep unquantized (router, embeddings, lm_head, GDN small parameters, norms) as they are."""
    directory = make_model_dir(model_type, seed=4, **SHAPES[model_type])
    expected = online_fp8_weights(directory)
    assert not any(".mlp.gate." in name or "in_proj_a" in name or "embed" in name for name in expected)
    model, weights = load(directory, "fp8")
    assert weights.online is not None
    assert_matches(model, dequantized_reference(directory, expected, tmp_path / "reference"), model_type)


def test_online_fp8_rounds_to_the_fp8_grid():
    """Each 128 x 128 block of a quantized weight, divided by its scale, is a float8 value."""
    w = torch.randn(200, 160, generator=torch.Generator().manual_seed(5))
    rounded = fake_block_fp8(w)
    for i, j in ((0, 0), (1, 1)):
        tile = rounded[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
        scaled = tile / (w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max() / 448)
        assert torch.allclose(scaled, scaled.to(torch.float8_e4m3fn).float(), rtol=1e-6, atol=1e-6)


def test_dummy_weights_with_fp8(make_model_dir):
    """--load-format dummy --quantization fp8: the random projections are rounded through block FP8 shard by shard
    (each HF projection on its own blocks); the router, embeddings and GDN in_proj_b / in_proj_a are not."""
    from pipeline.models.quantized_weights import quantize_dummy_weights

    arch = ModelArchConfig.from_hf(load_hf_config(str(make_model_dir("qwen3_5_moe_text", seed=6, hidden_size=200))))
    plain = build_model(arch, None, prepack=False)
    rounded = build_model(arch, None, prepack=False, after_weights=quantize_dummy_weights)
    layer, plain_layer = rounded.model.layers[0], plain.model.layers[0]
    proj, plain_proj = layer.linear_attn.in_proj, plain_layer.linear_attn.in_proj
    for shard in range(4):
        start, end = proj.shard_range(shard)
        want = plain_proj.weight[start:end]
        if shard < 2:  # qkv, z
            want = fake_block_fp8(want)
        assert torch.equal(proj.weight[start:end], want), shard
    moe, plain_moe = layer.mlp, plain_layer.mlp
    inter = moe.intermediate_size
    assert torch.equal(moe.w13[:, :inter], torch.stack([fake_block_fp8(w) for w in plain_moe.w13[:, :inter]]))
    assert torch.equal(moe.gate.weight, plain_moe.gate.weight)
    assert torch.equal(rounded.model.embed_tokens.weight, plain.model.embed_tokens.weight)


def test_checkpoint_kv_scales_reach_attention_layers(make_model_dir):
    directory = make_model_dir("qwen3_5_moe_text", seed=7, hidden_size=200)
    to_block_fp8(directory, extra={"model.layers.3.self_attn.k_scale": torch.tensor(0.5),
                                   "model.layers.3.self_attn.v_scale": torch.tensor([0.25])})
    model, weights = load(directory)
    assert weights.kv_scales == {"model.layers.3.self_attn.k_scale": 0.5, "model.layers.3.self_attn.v_scale": 0.25}
    attention = model.model.layers[3].self_attn
    assert (attention.k_scale, attention.v_scale) == (0.5, 0.25)
