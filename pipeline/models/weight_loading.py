"""Loading a checkpoint's tensors, given under their HF names, into a model built of the shared layers.

A family states how its checkpoint's names map onto its parameters as a ``WeightNames``: the HF projections that
load as shards of one fused parameter, prefixes renamed or skipped, and the tensors split before loading (a fused
HF projection that the model keeps in another order). ``load_hf_weights`` then fills every parameter: each
SparseMoeBlock loads its own experts' names (per-expert or stacked), a MergedLinear its shards (16-bit or FP8),
everything else by copy. It raises KeyError on an unknown name and ValueError on a shape mismatch or a missing
tensor, each naming the model type and the tensors.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from kernels.fp8 import Fp8Weight
from pipeline.models.config import ModelArchConfig
from pipeline.models.layers import MergedLinear
from pipeline.models.moe_layout import moe_blocks

# one checkpoint tensor as the tensors the model loads instead; None: not this splitter's tensor
TensorSplit = Callable[[str, torch.Tensor, ModelArchConfig], "list[tuple[str, torch.Tensor]] | None"]

_IGNORED_RE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_MOE_NAME_RE = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp)\.(.+)$")  # (the MTP head's layer too)


@dataclass(frozen=True, slots=True)
class WeightNames:
    """How a family's checkpoint names map onto its parameters."""

    fused: Mapping[str, tuple[str, int]]  # HF name piece -> (the fused parameter's piece, shard index)
    renamed: tuple[tuple[str, str], ...] = ()  # (checkpoint prefix, the model's); the first that matches applies
    skipped: tuple[str, ...] = ()  # prefixes (after renaming) of tensors the model never loads
    optional: tuple[str, ...] = ()  # top-level modules loaded only where the model built them ("mtp")
    splits: tuple[TensorSplit, ...] = ()  # the first that takes a tensor replaces it

    def model_tensors(self, model: nn.Module, arch: ModelArchConfig,
                      weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under the names ``load_hf_weights`` reads."""
        absent = tuple(f"{module}." for module in self.optional if getattr(model, module, None) is None)
        for name, tensor in weights:
            for prefix, replacement in self.renamed:
                if name.startswith(prefix):
                    name = replacement + name[len(prefix):]
                    break
            if name.startswith(self.skipped) or name.startswith(absent):
                continue
            for split in self.splits:
                parts = split(name, tensor, arch)
                if parts is not None:
                    yield from parts
                    break
            else:
                yield name, tensor


def _shown(names: list[str]) -> str:
    return ", ".join(names[:10]) + (f" ... (+{len(names) - 10} more)" if len(names) > 10 else "")


@torch.no_grad()
def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    fused: Mapping[str, tuple[str, int]], model_type: str) -> set[str]:
    """Load tensors given under the model's HF names into ``model``; returns the names loaded (a skipped
    non-local expert counts as consumed). A model without its own ``lm_head`` (tied) ignores ``lm_head.weight``."""
    blocks = moe_blocks(model)
    for block in blocks.values():
        block.begin_loading()
    moe_loaded: set[str] = set()

    def dense_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = _MOE_NAME_RE.match(name)
            block = blocks.get(m.group(1)) if m else None
            if block is None:
                yield name, tensor
                continue
            try:
                block.load_expert_weight(m.group(2), tensor)
            except KeyError:
                raise KeyError(f"{model_type}: unknown weight names: {name}") from None
            except ValueError as e:
                raise ValueError(f"{m.group(1)}.{e}") from None
            moe_loaded.add(name)

    prefixes = tuple(name + "." for name in blocks)
    params = {n: p for n, p in model.named_parameters() if not n.startswith(prefixes)}
    loaded = _load_dense(model, params, dense_weights(), fused, model_type)
    missing = [f"{prefix}.{n}" for prefix, block in blocks.items() for n in block.missing_weights()]
    if missing:
        raise ValueError(f"{model_type}: missing weights: {_shown(missing)}")
    return loaded | moe_loaded


def _load_dense(model: nn.Module, params: dict[str, nn.Parameter], weights: Iterable[tuple[str, torch.Tensor]],
                fused: Mapping[str, tuple[str, int]], model_type: str) -> set[str]:
    """Every parameter of ``params`` from ``weights``, fusing the pieces ``fused`` names."""
    # every (parameter, shard) that must be filled, keyed by the HF name that fills it
    expected: dict[str, tuple[str, int | None]] = {}
    for pname in params:
        mod_name, _, leaf = pname.rpartition(".")
        pieces = [(hf, fs, idx) for hf, (fs, idx) in fused.items() if mod_name.endswith("." + fs)]
        for hf_suffix, fs, idx in pieces:
            expected[f"{mod_name[: -len(fs)]}{hf_suffix}.{leaf}"] = (pname, idx)
        if not pieces:
            expected[pname] = (pname, None)
    tied = getattr(model, "lm_head", None) is None
    loaded: set[str] = set()
    unknown: list[str] = []
    for name, tensor in weights:
        if _IGNORED_RE.search(name) or (tied and name == "lm_head.weight"):
            continue
        target = expected.get(name)
        if target is None:
            unknown.append(name)
            continue
        pname, shard = target
        param = params[pname]
        module_name, _, leaf = pname.rpartition(".")
        module = model.get_submodule(module_name) if shard is not None or leaf == "weight" else None
        if isinstance(module, MergedLinear) and leaf == "weight":  # 16-bit or FP8 storage (fp8_storage.py)
            module.load_weight(shard, name, tensor)
            loaded.add(name)
            continue
        if shard is None:
            dst = param.data
        else:
            start, end = module.shard_range(shard)
            dst = param.data[start:end]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
        dst.copy_(tensor.dequantize(dst.dtype) if isinstance(tensor, Fp8Weight) else tensor)
        loaded.add(name)
    if unknown:
        raise KeyError(f"{model_type}: unknown weight names: {_shown(unknown)}")
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"{model_type}: missing weights: {_shown(missing)}")
    return loaded
