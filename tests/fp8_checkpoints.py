"""Test helpers that rewrite a saved tiny HF checkpoint the way FP8 checkpoints are published, and the transformers
reference holding what those weights stand for.

- ``to_block_fp8``: Qwen's *-FP8 layout (``quant_method: "fp8"``): every projection float8_e4m3fn with a
  ``weight_scale_inv`` per 128 x 128 block (partial at the edges; bf16 or fp32 scales), experts one tensor each,
  the router, shared_expert_gate, Gated DeltaNet in_proj_a / in_proj_b / conv1d / A_log / dt_bias, norms, embeddings
  and lm_head left as they were and listed in ``modules_to_not_convert``.
- ``to_compressed_tensors``: llm-compressor's FP8_DYNAMIC layout: float8 ``weight`` and ``weight_scale`` per output
  channel ([out, 1]) or per tensor ([1]), ``ignore`` naming lm_head and the routers.

Each returns the dequantized value of every tensor it quantized (float32, HF names), for ``dequantized_reference``.
The quantization here is written apart from pipeline/ on purpose: it is the fixture the loader is checked against.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

E4M3_MAX = 448.0
_PROJECTION = re.compile(r"_proj(_qkvz|_qkv|_z)?\.weight$")
_KEPT = re.compile(r"(in_proj_a|in_proj_b|in_proj_ba)\.weight$")
NOT_CONVERTED = ["lm_head", "model.embed_tokens", "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a",
                 "linear_attn.in_proj_b", "linear_attn.conv1d"]


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(directory / "model.safetensors", framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and bool(_PROJECTION.search(name)) and not _KEPT.search(name)


def _block_quantize(w: torch.Tensor, block: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    grid_r, grid_c = -(-rows // block), -(-cols // block)
    scale = torch.empty(grid_r, grid_c)
    for i in range(grid_r):
        for j in range(grid_c):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            amax = float(tile.abs().max())
            scale[i, j] = amax / E4M3_MAX if amax > 0 else 1.0
    stored = scale.to(scale_dtype)
    full = stored.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    q = (w.float() / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, stored


def _block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = q.shape
    full = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return q.float() * full


def _write(directory: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> None:
    save_file(tensors, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))


def to_block_fp8(directory: Path, scale_dtype: torch.dtype = torch.bfloat16, block: int = 128,
                 extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Rewrite ``directory``'s model.safetensors in the official block-FP8 layout (``extra``: tensors added as they
    are, e.g. KV scales). Returns {HF name: dequantized float32} of the tensors quantized."""
    directory = Path(directory)
    out, dequantized = {}, {}
    for name, tensor in _tensors(directory).items():
        if _quantized(name, tensor):
            q, scale = _block_quantize(tensor.float(), block, scale_dtype)
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
            dequantized[name] = _block_dequantize(q, scale, block)
        else:
            out[name] = tensor
    out.update(extra or {})
    _write(directory, out, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [block, block], "modules_to_not_convert": NOT_CONVERTED})
    return dequantized


def to_compressed_tensors(directory: Path, strategy: str = "channel",
                          scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Rewrite ``directory`` as an llm-compressor FP8_DYNAMIC checkpoint, weight scales per ``strategy``
    ("channel" or "tensor")."""
    directory = Path(directory)
    out, dequantized = {}, {}
    for name, tensor in _tensors(directory).items():
        if _quantized(name, tensor):
            w = tensor.float()
            amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().max().reshape(1)
            scale = (amax / E4M3_MAX).to(scale_dtype)
            full = scale.float() if strategy == "channel" else scale.float().reshape(1, 1)
            q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            out[name], out[name.removesuffix("weight") + "weight_scale"] = q, scale
            dequantized[name] = q.float() * full
        else:
            out[name] = tensor
    group = {"targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                   "dynamic": True}}
    _write(directory, out, {"quant_method": "compressed-tensors", "format": "float-quantized",
                            "config_groups": {"group_0": group}, "quantization_status": "compressed",
                            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$",
                                       "re:.*in_proj_[ab]$"]})
    return dequantized


def fake_block_fp8(tensor: torch.Tensor, block: int = 128) -> torch.Tensor:
    """What --quantization fp8 makes of a weight: 128 x 128 block FP8 with float32 scales, dequantized."""
    q, scale = _block_quantize(tensor.float(), block, torch.float32)
    return _block_dequantize(q, scale, block)


def online_fp8_weights(directory: Path) -> dict[str, torch.Tensor]:
    """What --quantization fp8 should make of ``directory``'s plain checkpoint: each projection but the MTP head's
    through 128 x 128 block FP8 (float32 scales), dequantized; the rest as it is."""
    return {name: fake_block_fp8(tensor) for name, tensor in _tensors(Path(directory)).items()
            if _quantized(name, tensor) and not name.startswith("mtp.")}


def dequantized_checkpoint(directory: Path, dequantized: dict[str, torch.Tensor], target: Path) -> Path:
    """The quantized checkpoint in ``directory`` written to ``target`` as a plain float32 one holding each quantized
    weight's dequantized value (its tokenizer and other files copied): the model an FP8 load must equal."""
    directory, target = Path(directory), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    plain = {name: dequantized.get(name, tensor) for name, tensor in _tensors(directory).items()
             if not name.endswith(("weight_scale_inv", "weight_scale", "k_scale", "v_scale"))}
    save_file({name: tensor.float().contiguous() for name, tensor in plain.items()}, target / "model.safetensors")
    for item in directory.iterdir():
        if item.is_file() and item.name not in ("model.safetensors", "config.json"):
            (target / item.name).write_bytes(item.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config", None)
    (target / "config.json").write_text(json.dumps(config))
    return target


def dequantized_reference(directory: Path, dequantized: dict[str, torch.Tensor], scratch: Path):
    """transformers' model (float32, eager) of ``dequantized_checkpoint`` (loaded from ``scratch``, so transformers
    stacks the experts as it does for any checkpoint)."""
    from transformers import AutoModelForCausalLM

    path = dequantized_checkpoint(directory, dequantized, scratch)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
