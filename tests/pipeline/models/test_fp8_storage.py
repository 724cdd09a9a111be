"""FP8 weights kept as FP8 (pipeline/models/fp8_storage.py), the form the GPU loads FP8 checkpoints in: built here on
the CPU from the same weight stream with ``keep_fp8`` on, every projection and expert stack holds the checkpoint's
e4m3 bytes and scales, whose dequantized values equal the CPU path's dequantized weights exactly; fused shards keep
128-row scale blocks where every shard starts on one and turn per-row where not; the Gated DeltaNet in_proj keeps its
b / a rows in 16 bits; expert parallelism keeps a rank's experts and heads; a model on the storage (the torch
references run it on the CPU) computes the dequantized model's logits. On a GPU the engine's own load (fp8 storage,
the FP8 kernels) is checked against the dequantized model."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.fp8 import Fp8Weight, dequantize_fp8_ref, quantize_fp8_block_ref, rows_are_blocks
from pipeline.dist.group import ExpertShard
from pipeline.models.config import ModelArchConfig
from pipeline.models.layers import MergedLinear
from pipeline.models.loader import load_hf_config
from pipeline.models.moe import SparseMoeBlock
from pipeline.models.quantized_weights import (_fp8_modules, _quantize_dummy_to_storage, checkpoint_weights,
                                               quantize_dummy_weights)
from pipeline.models.registry import build_model
from tests.fp8_checkpoints import to_block_fp8, to_compressed_tensors
from tests.model_utils import run_paged

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SHAPES = {"qwen3": dict(hidden_size=200, intermediate_size=160),
          # every fused shard a multiple of 128 rows: q, k, v 128 (2 heads of 64), gate / up 256
          "qwen3_aligned": dict(hidden_size=200, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
                                head_dim=64),
          "qwen3_moe": dict(hidden_size=200),
          "qwen3_5_moe_text": dict(hidden_size=200)}


def load(directory, keep_fp8: bool, quantization: str | None = None, shard: ExpertShard = ExpertShard(),
         device: str = "cpu", dtype: torch.dtype = torch.float32):
    hf_config = load_hf_config(str(directory))
    arch = ModelArchConfig.from_hf(hf_config)
    local = None
    if shard.size > 1:
        arch = dataclasses.replace(arch, expert_shard=shard, linear_head_shard=shard)
        first, count = shard.experts(arch.num_experts)
        local = (first, first + count)
    weights = checkpoint_weights(str(directory), hf_config, quantization, dtype, torch.device(device), local)
    weights.keep_fp8 = keep_fp8
    return build_model(arch, weights, dtype, device, prepack=False)


def value(module) -> dict[str, torch.Tensor]:
    """A module's weights as the values they stand for (FP8 storage dequantized to the model's dtype)."""
    if isinstance(module, MergedLinear):
        if module.weight_scale is None:
            return {"weight": module.weight.data}
        w = dequantize_fp8_ref(module.weight, module.weight_scale, module.scale_block, module.compute_dtype)
        return {"weight": w if module.tail is None else torch.cat([w, module.tail])}
    out = {}
    for which in ("w13", "w2"):
        scale = getattr(module, which + "_scale")
        stack = getattr(module, which)
        out[which] = stack.data if scale is None else dequantize_fp8_ref(
            stack, scale, getattr(module, which + "_block"), module.compute_dtype)
    return out


def assert_same_values(fp8_model, dense_model) -> dict[str, torch.nn.Module]:
    """Every projection and expert block of the FP8-stored model stands for the dense model's weights exactly, and
    every module FP8 checkpoints quantize is still FP8 (none fell back to 16 bits); returns those by name."""
    dense = dict(dense_model.named_modules())
    stored = {}
    for name, module in fp8_model.named_modules():
        if not isinstance(module, (MergedLinear, SparseMoeBlock)):
            continue
        for key, got in value(module).items():
            want = value(dense[name])[key]  # the dequantized weights, in the model's dtype
            assert torch.equal(got.to(want.dtype), want), (name, key)
        if getattr(module, "weight_scale", None) is not None or getattr(module, "w13_scale", None) is not None:
            stored[name] = module
    assert set(stored) == {name for name, _, _ in _fp8_modules(fp8_model)}
    return stored


def test_rows_and_columns_cut_exactly():
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_fp8_block_ref(w)
    weight = Fp8Weight(q, scale, (128, 128))
    full = weight.dequantize(torch.float32)
    for rows, kept in ((torch.arange(128, 300), True), (torch.cat([torch.arange(128, 256), torch.arange(128)]), True),
                       (torch.arange(0, 300, 2), False), (torch.arange(64, 192), False)):
        cut = weight.take_rows(rows)
        assert (cut.block[0] == 128) == kept == rows_are_blocks(rows, 128, 300)
        assert torch.equal(cut.dequantize(torch.float32), full[rows])
    assert torch.equal(weight.take_columns(128, 260).dequantize(torch.float32), full[:, 128:])
    assert weight.take_columns(64, 128) is None  # through a scale column: no exact form
    channel = Fp8Weight(q, torch.rand(300, 1), (1, 260))
    assert torch.equal(channel.take_columns(10, 50).dequantize(torch.float32),
                       channel.dequantize(torch.float32)[:, 10:50])


@pytest.mark.parametrize("model_type,scale_dtype", [("qwen3", torch.bfloat16), ("qwen3_aligned", torch.float32),
                                                    ("qwen3_moe", torch.bfloat16), ("qwen3_5_moe_text", torch.float32)])
def test_block_fp8_storage_holds_the_dequantized_weights(make_model_dir, model_type, scale_dtype):
    directory = make_model_dir(model_type.removesuffix("_aligned"), seed=2, **SHAPES[model_type])
    to_block_fp8(directory, scale_dtype)
    dense, fp8 = load(directory, False), load(directory, True)
    stored = assert_same_values(fp8, dense)
    layer = fp8.model.layers[0]
    attention = layer.self_attn if layer.self_attn is not None else fp8.model.layers[3].self_attn
    assert attention.qkv_proj.weight.dtype == torch.float8_e4m3fn and "lm_head" not in stored
    aligned = model_type == "qwen3_aligned"
    assert attention.qkv_proj.scale_block == ((128, 128) if aligned else (1, 128))  # shards 128 rows each, or not
    assert attention.o_proj.scale_block == (128, 128)  # one shard: the checkpoint's blocks as they are
    if model_type in ("qwen3", "qwen3_aligned"):
        assert layer.mlp.gate_up_proj.scale_block == ((128, 128) if aligned else (1, 128))
    if model_type in ("qwen3_moe", "qwen3_5_moe_text"):
        moe = layer.mlp
        assert moe.w13.dtype == moe.w2.dtype == torch.float8_e4m3fn and moe.gate.weight_scale is None
        assert moe.w13_block == (1, 128) and moe.w2_block == (128, 128)  # 32-row gate / up: per row
    if model_type == "qwen3_5_moe_text":
        in_proj = layer.linear_attn.in_proj  # qkv and z FP8, b and a (kept unquantized) the 16-bit tail
        assert in_proj.tail is not None and in_proj.tail.shape[0] == 2 * layer.linear_attn.num_v_heads
        assert layer.mlp.fold_shared and layer.mlp.w13.shape[0] == layer.mlp.num_local_experts + 1
    ids = torch.randint(100, 49000, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    want, got = run_paged(dense, [ids], 6, chunks=[16, 14]), run_paged(fp8, [ids], 6, chunks=[16, 14])
    torch.testing.assert_close(got.prompt_logits[0], want.prompt_logits[0], atol=1e-4, rtol=1e-4)
    assert got.generated == want.generated


@pytest.mark.parametrize("model_type,strategy", [("qwen3", "channel"), ("qwen3_moe", "tensor")])
def test_compressed_tensors_storage(make_model_dir, model_type, strategy):
    directory = make_model_dir(model_type, seed=3, **SHAPES[model_type])
    to_compressed_tensors(directory, strategy)
    dense, fp8 = load(directory, False), load(directory, True)
    assert_same_values(fp8, dense)
    attention = fp8.model.layers[0].self_attn
    assert attention.qkv_proj.scale_block == (1, 200)  # a channel scale, or three tensor scales: one a row
    assert attention.o_proj.scale_block == ((1, 64) if strategy == "channel" else (200, 64))


def test_online_fp8_and_expert_parallel_storage(make_model_dir):
    """--quantization fp8 into FP8 storage; and rank 1 of 2 under expert parallelism: its experts (and the folded
    shared expert) and, with the Gated DeltaNet heads split, its heads' rows and out_proj columns."""
    directory = make_model_dir("qwen3_5_moe_text", seed=4, hidden_size=200)
    assert_same_values(load(directory, True, "fp8"), load(directory, False, "fp8"))
    shard = ExpertShard(1, 2)
    dense, fp8 = load(directory, False, "fp8", shard), load(directory, True, "fp8", shard)
    stored = assert_same_values(fp8, dense)
    moe = fp8.model.layers[0].mlp
    assert moe.expert_offset == 4 and moe.w13.shape[0] == 5 and "model.layers.0.mlp" in stored
    mixer = fp8.model.layers[0].linear_attn
    assert mixer.num_v_heads == 2 and mixer.in_proj.weight.dtype == torch.float8_e4m3fn


def test_dummy_fp8_storage_holds_the_rounded_weights(make_model_dir):
    """--load-format dummy with FP8 on the GPU: the random projections quantized into storage stand for the values
    the CPU's in-place rounding gives."""
    arch = ModelArchConfig.from_hf(load_hf_config(str(make_model_dir("qwen3_5_moe_text", seed=6, hidden_size=200))))
    rounded = build_model(arch, None, prepack=False, after_weights=quantize_dummy_weights)
    stored = build_model(arch, None, prepack=False, after_weights=_quantize_dummy_to_storage)
    assert len(assert_same_values(stored, rounded)) > 0


def weight_bytes(model, names) -> int:
    modules = dict(model.named_modules())
    return sum(t.numel() * t.element_size() for name in names
               for t in [*modules[name].parameters(recurse=False), *modules[name].buffers(recurse=False)])


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_aligned", "qwen3_5_moe_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fp8_model_equals_the_dequantized_model(make_model_dir, model_type, dtype):
    """On cuda the weight stream keeps FP8 (``checkpoint_weights``' default there): the model holds the FP8 storage,
    runs the FP8 kernels (decode GEMVs with the fused norm, prefill GEMMs, MoE) and computes the logits of the model
    of the dequantized weights, from about half the projection bytes in bf16."""
    directory = make_model_dir(model_type.removesuffix("_aligned"), seed=2, **SHAPES[model_type])
    to_block_fp8(directory, torch.float32)
    hf_config = load_hf_config(str(directory))
    assert checkpoint_weights(str(directory), hf_config, None, dtype, torch.device("cuda")).keep_fp8
    fp8, dense = load(directory, True, device="cuda", dtype=dtype), load(directory, False, device="cuda", dtype=dtype)
    stored = assert_same_values(fp8, dense)
    assert weight_bytes(fp8, stored) < weight_bytes(dense, stored) * (0.65 if dtype == torch.bfloat16 else 0.35)
    ids = torch.randint(100, 49000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    want, got = run_paged(dense, [ids], 8, chunks=[24, 16]), run_paged(fp8, [ids], 8, chunks=[24, 16])
    if dtype == torch.float32:
        scale = want.prompt_logits[0].abs().max().item()
        torch.testing.assert_close(got.prompt_logits[0], want.prompt_logits[0], atol=1e-3 * scale, rtol=0)
        assert got.generated == want.generated
        return
    # bf16: the FP8 kernels scale each tile's fp32 product where the dequantized model rounds w * s to bf16 first, so
    # the two differ by bf16 rounding, and in a MoE a rounding can move a token to another expert. Both are held to
    # the fp32 model of the same weights: the FP8 path's mean error no worse than twice the 16-bit path's.
    exact = run_paged(load(directory, False, device="cuda", dtype=torch.float32), [ids], 0, chunks=[24, 16])
    reference = exact.prompt_logits[0]
    fp8_error = (got.prompt_logits[0].float() - reference).abs().mean().item()
    dense_error = (want.prompt_logits[0].float() - reference).abs().mean().item()
    assert fp8_error <= 2 * dense_error, (fp8_error, dense_error)
