"""The checkpoint's tensors as a model loads them, whatever their quantization: each FP8 weight is read with its scale
and dequantized (``Fp8Weight``), the attention layers' ``k_scale`` / ``v_scale`` are set aside for an fp8 KV cache,
``--quantization fp8`` rounds the projections of a 16/32-bit checkpoint through block FP8, and under expert
parallelism a rank reads only its own experts' weights and scales. The models see plain HF-named tensors, except on
the GPU (``keep_fp8``): there each FP8 weight comes as its ``Fp8Weight`` (the checkpoint's bytes and scales, or
``--quantization fp8``'s), and ``prepare`` first gives the model's quantized projections and expert stacks FP8
storage to take them (pipeline/models/fp8_storage.py), so the weights stay one byte each.

Every problem is a `CheckpointError` naming the tensor: an FP8 weight without its scale, a scale without its weight or
of the wrong shape, FP8 tensors in a checkpoint whose config.json declares no quantization. `check_checkpoint` runs the
same checks on the headers alone, before the server binds its port.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.dispatch import use_triton
from kernels.fp8 import BLOCK_128, fake_quantize_fp8_block_ref, is_fp8, quantize_fp8_block_ref, scale_grid
from pipeline.errors import CheckpointError
from pipeline.models.gguf_file import is_gguf_path
from pipeline.models.loader import SafetensorsCheckpoint, iter_weights, load_hf_config
from pipeline.models.quantization import (ONLINE_FP8, Fp8Scheme, Fp8Weight, checkpoint_scheme, online_scheme,
                                          quantized_online, scale_shape_fits)

_KV_SCALE = re.compile(r"^(.*\.self_attn)\.(k_scale|v_scale|kv_scale)$")
_UNUSED_SUFFIXES = (".input_scale", ".self_attn.q_scale", ".self_attn.prob_scale")  # activations: not quantized here
_EXPERT = re.compile(r"^model\.(?:language_model\.)?layers\.\d+\.mlp\.experts\.(\d+)\.")  # not the MTP head's
_FP8_HEADER_DTYPES = ("F8_E4M3", "F8_E5M2")


@dataclass(slots=True)
class CheckpointWeights:
    """An iterable of (HF name, tensor) for ``build_model``; after it ran, ``kv_scales`` holds the checkpoint's KV
    cache scales by HF name. Dequantized weights come out in ``dtype``, computed on ``device``."""

    path: str
    scheme: Fp8Scheme | None  # the checkpoint's quantization
    online: Fp8Scheme | None  # --quantization's, for a checkpoint without one
    dtype: torch.dtype
    device: torch.device
    experts: tuple[int, int] | None = None  # expert parallelism: the routed experts [lo, hi) this rank reads
    kv_scales: dict[str, float] = field(default_factory=dict)
    keep_fp8: bool = False  # FP8 weights come as Fp8Weight, for FP8 storage (the GPU), instead of dequantized

    @property
    def fp8_scheme(self) -> Fp8Scheme | None:
        """The scheme of the FP8 weights this stream yields as ``Fp8Weight`` (None: it yields none)."""
        return (self.scheme or self.online) if self.keep_fp8 else None

    def prepare(self, model: nn.Module) -> None:
        """Before the model loads from this stream: FP8 storage for its quantized modules (``keep_fp8`` only)."""
        if self.fp8_scheme is not None:
            prepare_fp8_storage(model, self.fp8_scheme)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if is_gguf_path(self.path):  # GGUF tensors come dequantized from their own formats
            for name, tensor in iter_weights(self.path):
                yield name, self._online(name, tensor)
            return
        reader = SafetensorsCheckpoint(self.path)
        for name in reader.names():
            if self._set_aside(reader, name) or not self._local(name):
                continue
            tensor = reader.get(name)
            if is_fp8(tensor.dtype):
                scale_name = check_fp8_weight(reader, name, self.scheme)
                assert self.scheme is not None
                block = self.scheme.block_for(tuple(tensor.shape))
                scale = reader.get(scale_name).to(self.device).float().reshape(scale_grid(tuple(tensor.shape), block))
                weight = Fp8Weight(tensor.to(self.device), scale, block)
                yield name, weight if self.keep_fp8 else weight.dequantize(self.dtype)
            else:
                yield name, self._online(name, tensor)

    def _set_aside(self, reader: SafetensorsCheckpoint, name: str) -> bool:
        """Whether ``name`` is not a tensor of its own for the model: a KV scale (kept), a weight scale (read with its
        weight), an activation scale (unused: activations are not quantized on this path)."""
        if _KV_SCALE.match(name):
            self.kv_scales[name] = kv_scale_value(name, reader.get(name))
            return True
        if self.scheme is not None and name.endswith("." + self.scheme.scale_suffix):
            check_scale(reader, name, self.scheme)
            return True
        return self.scheme is not None and name.endswith(_UNUSED_SUFFIXES)

    def _local(self, name: str) -> bool:
        if self.experts is None:
            return True
        m = _EXPERT.match(name)
        return m is None or self.experts[0] <= int(m.group(1)) < self.experts[1]

    def _online(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.online is None or not quantized_online(name, tensor):
            return tensor
        assert self.online.block is not None
        q, scale = quantize_fp8_block_ref(tensor.to(self.device), self.online.block)
        weight = Fp8Weight(q, scale, self.online.block)
        return weight if self.keep_fp8 else weight.dequantize(self.dtype)


def checkpoint_weights(path: str, hf_config: dict, quantization: str | None, dtype: torch.dtype,
                       device: torch.device, experts: tuple[int, int] | None = None) -> CheckpointWeights:
    scheme = checkpoint_scheme(hf_config)
    return CheckpointWeights(path, scheme, online_scheme(quantization, scheme), dtype, device, experts,
                             keep_fp8=use_triton(device))


def check_fp8_weight(reader: SafetensorsCheckpoint, name: str, scheme: Fp8Scheme | None) -> str:
    """The scale tensor's name for the float8 tensor ``name``, which must exist with one value per block."""
    if scheme is None:
        raise CheckpointError(f"{name} is stored as float8 ({reader.dtype_name(name)}) but config.json has no "
                              "quantization_config")
    if not name.endswith(".weight"):
        raise CheckpointError(f"{name} is stored as float8 but only '.weight' tensors can be quantized")
    scale_name = name[:-len("weight")] + scheme.scale_suffix
    if scale_name not in reader:
        raise CheckpointError(f"{name} is float8 but the checkpoint has no {scale_name}")
    check_shapes(name, reader.shape(name), scale_name, reader.shape(scale_name), scheme)
    return scale_name


def check_scale(reader: SafetensorsCheckpoint, scale_name: str, scheme: Fp8Scheme) -> None:
    """A scale must sit beside its float8 weight."""
    name = scale_name[:-len(scheme.scale_suffix)] + "weight"
    if name not in reader:
        raise CheckpointError(f"{scale_name} has no weight {name} beside it")
    if reader.dtype_name(name) not in _FP8_HEADER_DTYPES:
        raise CheckpointError(f"{scale_name} scales {name}, which is {reader.dtype_name(name)}, not float8")


def check_shapes(name: str, shape: tuple[int, ...], scale_name: str, scale_shape: tuple[int, ...],
                 scheme: Fp8Scheme) -> None:
    if len(shape) < 2:
        raise CheckpointError(f"{name} is float8 of shape {list(shape)}: quantized weights are matrices")
    block = scheme.block_for(shape)
    if not scale_shape_fits(scale_shape, shape, block):
        grid = [-(-shape[-2] // block[0]), -(-shape[-1] // block[1])]
        raise CheckpointError(f"{scale_name} has shape {list(scale_shape)}; {name} {list(shape)} in "
                              f"{block[0]}x{block[1]} blocks needs {[*shape[:-2], *grid]}")


def kv_scale_value(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise CheckpointError(f"{name} has {tensor.numel()} values; a KV cache scale is one per layer")
    value = float(tensor.float().reshape(()))
    if not value > 0 or value == float("inf"):
        raise CheckpointError(f"{name} is {value}; a KV cache scale must be positive and finite")
    return value


def check_checkpoint(path: str) -> Fp8Scheme | None:
    """The checks loading makes, on config.json and the safetensors headers only (no tensor is read but the KV
    scales): the server runs them before it binds its port. Returns the checkpoint's scheme."""
    scheme = checkpoint_scheme(load_hf_config(path))
    if is_gguf_path(path):
        return scheme
    reader = SafetensorsCheckpoint(path)
    for name in reader.names():
        if _KV_SCALE.match(name):
            kv_scale_value(name, reader.get(name))
        elif scheme is not None and name.endswith("." + scheme.scale_suffix):
            check_scale(reader, name, scheme)
        elif reader.dtype_name(name) in _FP8_HEADER_DTYPES:
            check_fp8_weight(reader, name, scheme)
    return scheme


def checkpoint_problem(model: str | None, load_format: str = "auto") -> str | None:
    """``check_checkpoint``'s refusal as one line, or None; a path that does not resolve is left to the load, which
    says so, and random weights read no files."""
    from pipeline.models.loader import resolve_model_path

    try:
        path = resolve_model_path(model)
    except (OSError, ValueError):
        return None
    if load_format == "dummy" or is_gguf_path(path):
        return None
    try:
        check_checkpoint(path)
    except CheckpointError as exc:
        return str(exc)
    return None


def apply_kv_scales(model: nn.Module, kv_scales: dict[str, float]) -> None:
    """The checkpoint's ``<attention>.k_scale`` / ``v_scale`` (or one ``kv_scale``) onto the model's attention layers
    (``PagedAttention.k_scale`` / ``v_scale``). Scales of a head the model did not build (the MTP head) are dropped."""
    from pipeline.models.self_attention import PagedAttention

    modules = dict(model.named_modules())
    for name, value in kv_scales.items():
        m = _KV_SCALE.match(name)
        assert m is not None
        path = re.sub(r"^model\.language_model\.", "model.", m.group(1))
        attention = modules.get(path)
        if attention is None and path.startswith("mtp."):
            continue
        if not isinstance(attention, PagedAttention):
            raise CheckpointError(f"{name}: the model has no attention layer {path}")
        if m.group(2) in ("k_scale", "kv_scale"):
            attention.k_scale = value
        if m.group(2) in ("v_scale", "kv_scale"):
            attention.v_scale = value


_DUMMY_PROJECTION = re.compile(r"\.(self_attn\.(qkv_proj|o_proj)|(mlp|shared_expert)\.(gate_up_proj|down_proj)"
                               r"|linear_attn\.(in_proj|out_proj))$")


def _fp8_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, int | None]]:
    """The modules whose weights FP8 checkpoints quantize (the ones ``quantized_online`` picks), with the number of
    leading shards quantized (the Gated DeltaNet in_proj: qkv and z, not b and a); None for an expert block."""
    from pipeline.models.layers import MergedLinear
    from pipeline.models.moe import SparseMoeBlock

    for name, module in model.named_modules():
        if name.startswith("mtp."):
            continue
        if isinstance(module, MergedLinear) and _DUMMY_PROJECTION.search(name):
            yield name, module, 2 if name.endswith("linear_attn.in_proj") else len(module.out_sizes)
        elif isinstance(module, SparseMoeBlock):
            yield name, module, None


def prepare_fp8_storage(model: nn.Module, scheme: Fp8Scheme) -> None:
    """FP8 storage (pipeline/models/fp8_storage.py) in ``scheme``'s blocks for every module ``_fp8_modules`` names,
    before loading. A module the checkpoint keeps in 16 bits after all falls back to 16 bits as it loads."""
    from pipeline.models import fp8_storage

    for _, module, shards in _fp8_modules(model):
        if shards is None:
            fp8_storage.moe_to_fp8(module, scheme)
        else:
            fp8_storage.linear_to_fp8(module, shards, scheme)


@torch.no_grad()
def _quantize_dummy_to_storage(model: nn.Module) -> None:
    """The GPU's --load-format dummy with FP8: each random projection quantized (128 x 128 blocks, shard by shard)
    into FP8 storage, as a checkpoint's FP8 weights load."""
    from pipeline.models import fp8_storage

    for name, module, shards in _fp8_modules(model):
        if shards is None:
            dense = {which: getattr(module, which).data for which in ("w13", "w2")}
            fp8_storage.moe_to_fp8(module, ONLINE_FP8)
            inter = module.intermediate_size
            for which, start, part in (("w13", 0, dense["w13"][:, :inter]), ("w13", inter, dense["w13"][:, inter:]),
                                       ("w2", 0, dense["w2"])):
                q, scale = quantize_fp8_block_ref(part, BLOCK_128)
                fp8_storage.load_expert_rows(module, which, slice(None), start, name, Fp8Weight(q, scale, BLOCK_128))
            continue
        dense = module.weight.data
        fp8_storage.linear_to_fp8(module, shards, ONLINE_FP8)
        for shard in range(shards):
            start, end = module.shard_range(shard)
            q, scale = quantize_fp8_block_ref(dense[start:end], BLOCK_128)
            module.load_weight(shard, name, Fp8Weight(q, scale, BLOCK_128))


@torch.no_grad()
def quantize_dummy_weights(model: nn.Module) -> None:
    """--load-format dummy with --quantization fp8: the random projections rounded through block FP8 in place, each
    HF projection (a shard of a fused one, an expert's gate or up half) on its own blocks, the same ones
    ``quantized_online`` picks from a checkpoint (the Gated DeltaNet in_proj: its qkv and z shards, not b and a).
    On the GPU they become FP8 storage holding those blocks instead."""
    from pipeline.models.layers import MergedLinear
    from pipeline.models.moe import SparseMoeBlock

    if use_triton(next(model.parameters()).device):
        _quantize_dummy_to_storage(model)
        return
    for name, module in model.named_modules():
        if name.startswith("mtp."):
            continue
        if isinstance(module, MergedLinear) and _DUMMY_PROJECTION.search(name):
            shards = (0, 1) if name.endswith("linear_attn.in_proj") else range(len(module.out_sizes))
            for shard in shards:
                start, end = module.shard_range(shard)
                part = module.weight.data[start:end]
                part.copy_(fake_quantize_fp8_block_ref(part))
        elif isinstance(module, SparseMoeBlock):
            inter = module.intermediate_size
            for part in (module.w13.data[:, :inter], module.w13.data[:, inter:], module.w2.data):
                part.copy_(fake_quantize_fp8_block_ref(part))
