"""The model registry (pipeline/models/registry.py): one entry per family, each model_type served by exactly one,
the entry's config mapping being what config.json is read with, its packaged template, and families built of the
shared layers rather than of each other."""
from __future__ import annotations

import pytest
import torch

from pipeline.models.causal_lm import CausalLM
from pipeline.models.config import PLAIN_MAPPING, ModelArchConfig
from pipeline.models.registry import FAMILIES, FAMILY_BY_MODEL_TYPE, config_mapping, model_family
from pipeline.models.weight_loading import WeightNames
from pipeline.templates import builtin_chat_template
from tests.model_utils import tiny_config


def test_every_model_type_has_exactly_one_family() -> None:
    types = [t for family in FAMILIES for t in family.model_types]
    assert len(types) == len(set(types)) == len(FAMILY_BY_MODEL_TYPE)
    assert len({family.name for family in FAMILIES}) == len(FAMILIES)
    for family in FAMILIES:
        assert all(model_family(t) is family for t in family.model_types)


def test_unknown_model_type_is_refused_with_the_supported_list() -> None:
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'; supported: .*qwen3_moe"):
        model_family("gpt2")
    assert config_mapping("gpt2") is PLAIN_MAPPING


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_family_facts(family) -> None:
    assert issubclass(family.model_class, CausalLM)
    assert isinstance(family.weight_names, WeightNames) and family.weight_names is family.model_class.weight_names
    if family.chat_template is not None:
        assert builtin_chat_template(family.chat_template)
    assert (family.tool_call_parser is None) == (family.reasoning_parser is None) == (family.chat_template is None)


def test_no_family_class_is_another_family_class() -> None:
    """Each family's model class derives from the shared shell alone, never from another family's class."""
    classes = {family.model_class for family in FAMILIES}
    for cls in classes:
        assert not [base for base in cls.__mro__[1:] if base in classes], cls


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"])
def test_the_entry_mapping_reads_config_json(model_type: str) -> None:
    """from_hf by default reads a config with its family's mapping, and a mapping passed in overrides it."""
    config = tiny_config(model_type, attention_bias=True).to_dict()
    mapping = model_family(model_type).config
    arch = ModelArchConfig.from_hf(config)
    assert arch == ModelArchConfig.from_hf(config, mapping)
    assert arch.qk_norm == mapping.qk_norm
    assert (arch.attention_bias, arch.o_proj_bias) == (True, not mapping.qkv_bias_only)
    assert arch.is_hybrid == mapping.hybrid == arch.zero_centered_norm
    if not mapping.all_layers_sparse:  # (read plainly, a config without intermediate_size is refused)
        plain = ModelArchConfig.from_hf(config, PLAIN_MAPPING)
        assert not plain.qk_norm and not plain.zero_centered_norm and not plain.attn_output_gate
        assert (plain.attention_bias, plain.o_proj_bias) == (True, True)


def test_all_layers_sparse_needs_no_intermediate_size() -> None:
    config = tiny_config("qwen3_5_moe_text").to_dict()
    config.pop("intermediate_size", None)
    arch = ModelArchConfig.from_hf(config)
    assert arch.intermediate_size == 0 and arch.norm_topk_prob and arch.decoder_sparse_step == 1
    with pytest.raises(ValueError, match="lacks required field 'intermediate_size'"):
        ModelArchConfig.from_hf({**config, "model_type": "qwen3_moe"})


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_each_family_builds_from_its_config(family) -> None:
    """A tiny model of each family's first type constructs with the registry's class and declares one cache per
    layer at least (the hybrids: two per Gated DeltaNet layer)."""
    # (a multimodal qwen3_5* type wraps its *_text config)
    model_type = next(t for t in family.model_types if not t.startswith("qwen3_5") or t.endswith("_text"))
    arch = ModelArchConfig.from_hf(tiny_config(model_type).to_dict())
    model = family.model_class(arch, dtype=torch.float32, device="meta")
    assert len(model.model.layers) == arch.num_layers
    specs = model.cache_specs(torch.float32)
    assert len(specs) == arch.num_layers + sum(kind == "linear_attention" for kind in arch.layer_types)
