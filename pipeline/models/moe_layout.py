"""Where a decoder's mixture-of-experts blocks go: which layers are sparse (transformers' rule), the block a sparse
layer gets (this rank's experts), and what a model with blocks does to them as a whole (join an expert group).

A layer's MLP is a SparseMoeBlock when ``num_experts > 0``, the layer is not in ``mlp_only_layers`` and
``(layer_index + 1) % decoder_sparse_step == 0``, else a dense GatedMLP of ``intermediate_size``.
"""
from __future__ import annotations

from torch import nn

from pipeline.dist.group import ExpertGroup
from pipeline.models.config import ModelArchConfig
from pipeline.models.layers import GatedMLP
from pipeline.models.moe import SparseMoeBlock


def check_moe_fields(arch: ModelArchConfig) -> None:
    """Raises ValueError when the config names experts without the fields that shape them."""
    if arch.num_experts > 0 and not (arch.num_experts_per_tok > 0 and arch.moe_intermediate_size > 0):
        raise ValueError(f"{arch.model_type}: num_experts={arch.num_experts} needs num_experts_per_tok and "
                         "moe_intermediate_size")


def is_sparse_layer(arch: ModelArchConfig, layer_index: int) -> bool:
    return (
        arch.num_experts > 0
        and layer_index not in arch.mlp_only_layers
        and (layer_index + 1) % arch.decoder_sparse_step == 0
    )


def sparse_moe_block(arch: ModelArchConfig, dtype=None, device=None) -> SparseMoeBlock:
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


def layer_mlp(arch: ModelArchConfig, layer_index: int, dtype=None, device=None) -> SparseMoeBlock | GatedMLP:
    """Layer ``layer_index``'s MLP by the rule in the module docstring."""
    if is_sparse_layer(arch, layer_index):
        return sparse_moe_block(arch, dtype, device)
    return GatedMLP.from_arch(arch, dtype, device)


def moe_blocks(model: nn.Module) -> dict[str, SparseMoeBlock]:
    """{module name (= HF prefix, e.g. "model.layers.1.mlp"): block}."""
    return {name: m for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)}


def join_expert_group(model: nn.Module, group: ExpertGroup) -> None:
    """Expert parallelism: every block sums its partial output over ``group`` (the ranks holding the other
    experts, ``arch.expert_shard``). A block holding every expert (the MTP head's) sums nothing."""
    for block in moe_blocks(model).values():
        if block.num_local_experts < block.num_experts:
            block.expert_group = group
