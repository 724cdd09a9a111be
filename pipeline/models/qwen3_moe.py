"""Qwen3-MoE: the Qwen3 decoder (q/k norm attention over the paged KV cache) with sparse MoE MLPs.

Everything but the MLP is llama.py's: embedding, norms, PagedAttention, rope, final norm, lm_head,
compute_logits, cache_specs. A layer's MLP is a SparseMoeBlock when ``num_experts > 0``, the layer is not in
``mlp_only_layers`` and ``(layer_index + 1) % decoder_sparse_step == 0`` (transformers' rule), else a dense
GatedMLP of ``intermediate_size``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pipeline.models.config import ModelArchConfig
from pipeline.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pipeline.models.moe import SparseMoeBlock
from pipeline.dist.group import ExpertGroup


def is_sparse_layer(arch: ModelArchConfig, layer_index: int) -> bool:
    return (
        arch.num_experts > 0
        and layer_index not in arch.mlp_only_layers
        and (layer_index + 1) % arch.decoder_sparse_step == 0
    )


def make_sparse_moe_block(arch: ModelArchConfig, dtype=None, device=None) -> SparseMoeBlock:
    """The block of this rank's experts (``arch.expert_shard``: all of them on one rank)."""
    expert_offset, num_local_experts = arch.expert_shard.experts(arch.num_experts)
    return SparseMoeBlock(
        arch.hidden_size,
        arch.moe_intermediate_size,
        arch.num_experts,
        arch.num_experts_per_tok,
        arch.norm_topk_prob,
        shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
        expert_offset=expert_offset,
        num_local_experts=num_local_experts,
        hidden_act=arch.hidden_act,
        dtype=dtype,
        device=device,
    )


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def _make_mlp(self, arch: ModelArchConfig, layer_index: int, dtype=None, device=None) -> nn.Module:
        if is_sparse_layer(arch, layer_index):
            return make_sparse_moe_block(arch, dtype, device)
        return super()._make_mlp(arch, layer_index, dtype, device)


_MOE_NAME_RE = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp)\.(.+)$")  # (the MTP head's layer too)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with Qwen3-MoE decoder layers; loads the experts' HF names (per-expert or stacked)
    into each SparseMoeBlock."""

    decoder_layer_cls = Qwen3MoeDecoderLayer

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype | None = None, device=None) -> None:
        if arch.num_experts > 0 and not (arch.num_experts_per_tok > 0 and arch.moe_intermediate_size > 0):
            raise ValueError(f"{arch.model_type}: num_experts={arch.num_experts} needs num_experts_per_tok and "
                             "moe_intermediate_size")
        super().__init__(arch, dtype, device)

    def join_expert_group(self, group: ExpertGroup) -> None:
        """Expert parallelism: every block sums its partial output over ``group`` (the ranks holding the other
        experts, ``arch.expert_shard``). A block holding every expert (the MTP head's) sums nothing."""
        for block in self._moe_blocks().values():
            if block.num_local_experts < block.num_experts:
                block.expert_group = group

    def _moe_blocks(self) -> dict[str, SparseMoeBlock]:
        """{module name (= HF prefix, e.g. "model.layers.1.mlp"): block}."""
        return {name: m for name, m in self.named_modules() if isinstance(m, SparseMoeBlock)}

    def _hf_loaded_params(self) -> dict[str, nn.Parameter]:
        prefixes = tuple(name + "." for name in self._moe_blocks())
        return {n: p for n, p in self.named_parameters() if not n.startswith(prefixes)}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        blocks = self._moe_blocks()
        for block in blocks.values():
            block._loaded.clear()
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
                    raise KeyError(f"{self.arch.model_type}: unknown weight names: {name}") from None
                except ValueError as e:
                    raise ValueError(f"{m.group(1)}.{e}") from None
                moe_loaded.add(name)  # skipped non-local experts count as consumed

        loaded = super().load_weights(dense_weights())
        missing = [f"{prefix}.{n}" for prefix, block in blocks.items() for n in block.missing_weights()]
        if missing:
            shown = ", ".join(missing[:10]) + (f" ... (+{len(missing) - 10} more)" if len(missing) > 10 else "")
            raise ValueError(f"{self.arch.model_type}: missing weights: {shown}")
        return loaded | moe_loaded
