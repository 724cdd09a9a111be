"""What a checkpoint's ``quantization_config`` says, for the FP8 formats people download, and which tensors
``--quantization fp8`` quantizes.

- ``quant_method: "fp8"`` (Qwen's *-FP8 releases): float8_e4m3fn weights with a ``weight_scale_inv`` per
  ``weight_block_size`` block (``[128, 128]``; partial blocks at the edges), activations quantized dynamically;
  without ``weight_block_size`` one ``weight_scale`` per tensor. ``modules_to_not_convert`` / ``ignored_layers``
  name what stays in 16 bits.
- ``quant_method: "compressed-tensors"`` (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK): float8 ``weight`` with a
  ``weight_scale`` per output channel (``[out, 1]``), per tensor (``[]`` / ``[1]``) or per block; ``ignore`` names
  what stays (module names or ``re:`` patterns).

Both read as one `Fp8Scheme`: a weight's scales cover blocks of its last two dimensions (a channel scale is a block
of one row, a tensor scale one block of the whole), so `Fp8Weight` (kernels/fp8.py) is the one form a quantized
tensor takes. Anything else is refused with a `CheckpointError` naming the field.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from kernels.fp8 import BLOCK_128, Fp8Weight, scale_grid  # noqa: F401 (Fp8Weight: the loader's form)
from pipeline.errors import CheckpointError

SUPPORTED_METHODS = ("fp8", "compressed-tensors")
ONLINE_METHODS = ("fp8",)  # --quantization values


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How a checkpoint's (or --quantization's) FP8 weights are scaled."""

    method: str  # "fp8", "compressed-tensors", or "online" (--quantization fp8 on a 16/32-bit checkpoint)
    strategy: str  # "block", "channel" or "tensor"
    block: tuple[int, int] | None  # the block strategy's (rows, cols)
    scale_suffix: str  # the scale tensor beside each "<module>.weight": "weight_scale_inv" or "weight_scale"
    unquantized: tuple[str, ...] = ()  # the modules the checkpoint keeps unquantized (names or "re:" patterns)

    def block_for(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The (rows, cols) one scale covers in a weight of ``shape`` (its last two dimensions)."""
        if self.strategy == "block":
            assert self.block is not None
            return self.block
        if self.strategy == "channel":
            return 1, shape[-1]
        return shape[-2], shape[-1]

    def describe(self) -> str:
        grid = f"{self.block[0]}x{self.block[1]} blocks" if self.strategy == "block" else f"per {self.strategy}"
        source = "--quantization fp8" if self.method == "online" else self.method
        return f"fp8 e4m3, {grid} ({source})"


ONLINE_FP8 = Fp8Scheme("online", "block", BLOCK_128, "weight_scale_inv")


def scale_shape_fits(scale_shape: tuple[int, ...], weight_shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    """A scale of ``scale_shape`` has one value per block of the weight (unit dimensions aside: a tensor scale may be
    ``[]``, ``[1]`` or ``[1, 1]``, a channel scale ``[out]`` or ``[out, 1]``)."""
    expected = scale_grid(weight_shape, block)
    return [d for d in scale_shape if d != 1] == [d for d in expected if d != 1]


def checkpoint_scheme(hf_config: dict[str, Any]) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme from config.json (a multimodal config may keep it under text_config); None for an
    unquantized checkpoint. Raises CheckpointError for a method or setting no path here loads."""
    config = hf_config.get("quantization_config")
    if config is None and isinstance(hf_config.get("text_config"), dict):
        config = hf_config["text_config"].get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise CheckpointError("config.json quantization_config is not an object")
    method = config.get("quant_method")
    if method == "fp8":
        return _block_fp8_scheme(config)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    raise CheckpointError(f"quantization_config.quant_method {method!r} is not supported: Conveyor loads "
                          f"{' and '.join(repr(m) for m in SUPPORTED_METHODS)} FP8 checkpoints")


def _block_fp8_scheme(config: dict[str, Any]) -> Fp8Scheme:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"quantization_config.fmt {fmt!r} is not supported (fp8 checkpoints load as e4m3)")
    activations = config.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise CheckpointError(f"quantization_config.activation_scheme {activations!r} is not supported (only "
                              "'dynamic': static activation scales have no path here)")
    unquantized = tuple(config.get("modules_to_not_convert") or ()) + tuple(config.get("ignored_layers") or ())
    block = config.get("weight_block_size")
    if block is None:
        return Fp8Scheme("fp8", "tensor", None, "weight_scale", unquantized)
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(n, int) and n > 0 for n in block)):
        raise CheckpointError(f"quantization_config.weight_block_size {block!r} is not two positive integers")
    return Fp8Scheme("fp8", "block", (block[0], block[1]), "weight_scale_inv", unquantized)


def _compressed_tensors_scheme(config: dict[str, Any]) -> Fp8Scheme:
    fmt = config.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise CheckpointError(f"compressed-tensors format {fmt!r} is not supported (FP8 'float-quantized' loads)")
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("compressed-tensors quantization_config has no config_groups")
    schemes = set()
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        where = f"compressed-tensors config_groups.{name}"
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise CheckpointError(f"{where}: weights of {weights.get('num_bits')} bits, type {weights.get('type')!r} "
                                  "are not supported (only 8-bit float)")
        if weights.get("symmetric") is False or weights.get("dynamic"):
            raise CheckpointError(f"{where}: asymmetric or dynamic weight scales are not supported")
        strategy = weights.get("strategy")
        block = None
        if strategy == "block":
            structure = weights.get("block_structure")
            if (not isinstance(structure, (list, tuple)) or len(structure) != 2
                    or not all(isinstance(n, int) and n > 0 for n in structure)):
                raise CheckpointError(f"{where}: block_structure {structure!r} is not two positive integers")
            block = (structure[0], structure[1])
        elif strategy not in ("channel", "tensor"):
            raise CheckpointError(f"{where}: weight strategy {strategy!r} is not supported (channel, tensor, block)")
        inputs = group.get("input_activations")
        if inputs is not None and not inputs.get("dynamic"):
            raise CheckpointError(f"{where}: static input activation scales are not supported (only dynamic)")
        schemes.add((strategy, block))
    if len(schemes) > 1:
        raise CheckpointError(f"compressed-tensors config_groups with different weight schemes {sorted(schemes)} "
                              "are not supported")
    strategy, block = schemes.pop()
    return Fp8Scheme("compressed-tensors", strategy, block, "weight_scale", tuple(config.get("ignore") or ()))


def online_scheme(quantization: str | None, checkpoint: Fp8Scheme | None) -> Fp8Scheme | None:
    """What ``--quantization`` adds to a checkpoint: block FP8 for a 16/32-bit one, nothing for one already FP8."""
    if quantization is None or checkpoint is not None:
        return None
    if quantization not in ONLINE_METHODS:
        raise CheckpointError(f"--quantization {quantization!r} is not supported (choose {', '.join(ONLINE_METHODS)})")
    return ONLINE_FP8


# The projections --quantization fp8 quantizes (HF names), as the official FP8 checkpoints do: attention, MLP and
# expert projections, the Gated DeltaNet's large input and output projections. Everything else keeps its dtype: the
# embeddings, lm_head, norms, the MoE router (mlp.gate) and shared_expert_gate, the Gated DeltaNet's in_proj_a /
# in_proj_b / in_proj_ba, conv1d, A_log and dt_bias, and the whole MTP head.
_QUANTIZED_PROJECTION = re.compile(
    r"\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj"
    r"|linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj))\.weight$"
    r"|\.mlp\.experts\.(gate_up_proj|down_proj)(\.weight)?$")
_KEPT_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")


def quantized_online(name: str, tensor: torch.Tensor) -> bool:
    """Whether --quantization fp8 quantizes the checkpoint tensor ``name``."""
    return (tensor.dim() in (2, 3) and tensor.is_floating_point() and not name.startswith(_KEPT_PREFIXES)
            and _QUANTIZED_PROJECTION.search(name) is not None)
