"""Reading GGUF files: metadata, an HF-style config, and tensors under their HF names.

A GGUF stores the ggml view of a model: llama.cpp tensor names, dimensions innermost-first,
block-quantized data and, for llama, Q/K rows permuted for llama.cpp's RoPE layout. Everything
here translates that back to what a transformers checkpoint of the same model would hold, so the
model code only ever sees one layout.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize


@dataclass(slots=True, frozen=True)
class GGUFArchitecture:
    """How one `general.architecture` maps onto transformers."""

    model_type: str
    hf_architecture: str
    # llama.cpp's converter permutes Q/K rows only for models it runs with "normal" (GPT-J style) RoPE.
    qk_rows_permuted: bool


GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", qk_rows_permuted=True),
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM", qk_rows_permuted=False),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM", qk_rows_permuted=False),
}

_GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp derives from the config (llama3 RoPE frequencies); transformers recomputes them.
_DERIVED_TENSORS = frozenset({"rope_freqs.weight"})
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def is_gguf_path(path: str) -> bool:
    return path.lower().endswith(".gguf")


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int) -> GGUFReader:
    return GGUFReader(path)


def open_gguf(path: str) -> GGUFReader:
    """A memory-mapped reader; cached because config, tokenizer and weights each need one."""
    path = os.path.abspath(path)
    return _open_cached(path, os.stat(path).st_mtime_ns)


def metadata_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as plain Python (str, int, float, bool, or a list of those)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def architecture_of(reader: GGUFReader) -> tuple[str, GGUFArchitecture]:
    name = metadata_value(reader, "general.architecture")
    spec = GGUF_ARCHITECTURES.get(name)
    if spec is None:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}."
        )
    return name, spec


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    """HF `rope_scaling` from llama.cpp's `{arch}.rope.scaling.*` keys (linear and yarn)."""
    kind = metadata_value(reader, f"{arch}.rope.scaling.type")
    factor = metadata_value(reader, f"{arch}.rope.scaling.factor")
    if kind is None and (legacy := metadata_value(reader, f"{arch}.rope.scale_linear")) is not None:
        kind, factor = "linear", legacy
    if kind in (None, "none") or factor is None:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        original = metadata_value(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = metadata_value(reader, f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                scaling[hf_key] = float(value)
        return scaling
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (linear, yarn).")


def gguf_hf_config(reader: GGUFReader) -> dict[str, Any]:
    """The config.json transformers would have for this model, synthesized from metadata."""
    arch, spec = architecture_of(reader)

    def meta(key: str, default: Any = None) -> Any:
        return metadata_value(reader, f"{arch}.{key}", default)

    hidden_size = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts; uniform models repeat one value
        num_kv_heads = max(num_kv_heads)
    head_dim = meta("attention.key_length") or meta("rope.dimension_count") or hidden_size // num_heads
    tensor_names = {tensor.name for tensor in reader.tensors}
    vocab_size = meta("vocab_size")
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens.data) if tokens is not None else _embedding_rows(reader)

    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "architectures": [spec.hf_architecture],
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(reader, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        value = metadata_value(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config["pad_token_id" if key == "padding_token_id" else key] = int(value)
    return config


def _embedding_rows(reader: GGUFReader) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise ValueError("GGUF has neither a vocab size, a token list nor token_embd.weight.")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor; None for tensors transformers derives itself."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    if gguf_name in _DERIVED_TENSORS:
        return None
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSOR_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF counterpart.")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[part]}.{kind}"


def tensor_to_torch(tensor: ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as a torch tensor in HF [out, in] orientation.

    F32/F16/BF16 keep their dtype; block-quantized types are dequantized to float32.
    """
    hf_shape = tuple(int(dim) for dim in reversed(tensor.shape))
    qtype = tensor.tensor_type
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(np.array(tensor.data, dtype=np.float32).reshape(hf_shape))
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(tensor.data, dtype=np.float16).reshape(hf_shape))
    if qtype == GGMLQuantizationType.BF16:
        raw = np.array(tensor.data).view(np.int16).reshape(hf_shape)
        return torch.from_numpy(raw).view(torch.bfloat16)
    values = dequantize(tensor.data, qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(hf_shape))


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    Per head, HF keeps the two RoPE halves as contiguous blocks of rows; llama.cpp interleaves
    them (row pairs). So GGUF rows are viewed as [head, pair, half] and swapped back to
    [head, half, pair]. Works for weights and biases alike.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape).contiguous()


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight, one tensor materialized at a time."""
    reader = open_gguf(path)
    _, spec = architecture_of(reader)
    config = gguf_hf_config(reader)
    heads_for = {
        "self_attn.q_proj": config["num_attention_heads"],
        "self_attn.k_proj": config["num_key_value_heads"],
    }
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        weight = tensor_to_torch(tensor)
        if spec.qk_rows_permuted:
            module = name.rsplit(".", 1)[0].split(".", 3)[-1]
            if module in heads_for:
                weight = unpermute_rope_rows(weight, heads_for[module])
        yield name, weight
