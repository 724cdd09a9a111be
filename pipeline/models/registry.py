"""The model families, one entry each with every fact the server needs about it, and ``build_model``.

An entry names the HF ``model_type`` values it serves, the model class (pipeline/models/families/: its layers and
its checkpoint's names, ``model_class.weight_names``), how its config.json maps onto ModelArchConfig, and its
serving defaults: a packaged chat template (pipeline/templates/) for checkpoints that ship none, and the tool-call
and reasoning parsers its training fixed. The parsers are names the web layer resolves (web/tool_call_parsers.py,
web/reasoning.py), so this table stays below it. docs/adding-a-model.md walks through adding an entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.models.config import PLAIN_MAPPING, ConfigMapping, ModelArchConfig
from pipeline.models.families.llama import LlamaForCausalLM
from pipeline.models.families.qwen3_moe import Qwen3MoeForCausalLM
from pipeline.models.families.qwen3_next import Qwen3NextForCausalLM
from pipeline.models.quantized_weights import CheckpointWeights
from pipeline.models.weight_loading import WeightNames


@dataclass(frozen=True, slots=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]  # the HF model_type values (a multimodal config's text model: its *_text type)
    model_class: type[nn.Module]
    config: ConfigMapping = PLAIN_MAPPING
    chat_template: str | None = None  # a packaged template's file name, for checkpoints without a template
    tool_call_parser: str | None = None  # None: the format the chat template writes
    reasoning_parser: str | None = None  # None: no reasoning split

    @property
    def weight_names(self) -> WeightNames:
        return self.model_class.weight_names


_QWEN3_5_SERVING = dict(chat_template="qwen3_5.jinja", tool_call_parser="qwen3_coder", reasoning_parser="qwen3")

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", ("llama", "mistral"), LlamaForCausalLM),
    ModelFamily("qwen2", ("qwen2",), LlamaForCausalLM,
                ConfigMapping(qkv_bias_only=True, sliding_window_switch=True)),
    ModelFamily("qwen3", ("qwen3",), LlamaForCausalLM, ConfigMapping(qk_norm=True, sliding_window_switch=True)),
    ModelFamily("qwen3_moe", ("qwen3_moe",), Qwen3MoeForCausalLM,
                ConfigMapping(qk_norm=True, sliding_window_switch=True)),
    # hybrid Gated DeltaNet + gated attention
    ModelFamily("qwen3_next", ("qwen3_next", "qwen3_5", "qwen3_5_text"), Qwen3NextForCausalLM,
                ConfigMapping(qk_norm=True, hybrid=True), **_QWEN3_5_SERVING),
    ModelFamily("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), Qwen3NextForCausalLM,
                ConfigMapping(qk_norm=True, hybrid=True, all_layers_sparse=True), **_QWEN3_5_SERVING),
)

FAMILY_BY_MODEL_TYPE: dict[str, ModelFamily] = {t: family for family in FAMILIES for t in family.model_types}
MODEL_REGISTRY: dict[str, type[nn.Module]] = {t: family.model_class for t, family in FAMILY_BY_MODEL_TYPE.items()}


def model_family(model_type: str) -> ModelFamily:
    """The entry serving ``model_type``; ValueError naming the supported types for any other."""
    try:
        return FAMILY_BY_MODEL_TYPE[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILY_BY_MODEL_TYPE))}"
        ) from None


def config_mapping(model_type: str) -> ConfigMapping:
    """The family's config mapping; a model_type no entry names reads config.json the plain way (building it
    then fails with ``model_family``'s error)."""
    family = FAMILY_BY_MODEL_TYPE.get(model_type)
    return family.config if family is not None else PLAIN_MAPPING


def get_model_class(model_type: str) -> type[nn.Module]:
    return model_family(model_type).model_class


def build_model(
    arch: ModelArchConfig,
    weights: Iterable[tuple[str, torch.Tensor]] | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    prepack: bool = True,
    mtp: bool = False,
    after_weights: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Construct directly on ``device``/``dtype``, load HF-named weights, eval mode, gradients off.

    ``mtp``: also the checkpoint's MTP head (Qwen3-Next / Qwen3.5). On CPU the projections are then prepacked
    for oneDNN (prepack=False keeps plain weights, e.g. to inspect them); the serving path and the parity tests
    both use the packed path. ``after_weights``: run on the model once its weights are in (see ``finish_model``)."""
    cls = get_model_class(arch.model_type)
    model = cls(arch, dtype=dtype, device=device)
    if mtp:  # the checkpoint's multi-token-prediction head, for speculation (pipeline/models/mtp.py)
        if not hasattr(model, "attach_mtp"):
            raise ValueError(f"{arch.model_type} has no MTP head: --speculative-method mtp needs a Qwen3-Next or "
                             "Qwen3.5 model")
        model.attach_mtp()
    return finish_model(model, weights, prepack, after_weights)


def finish_model(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]] | None,
                 prepack: bool = True, after_weights: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """A constructed model made ready to serve: its weights loaded (random ones without), eval mode, gradients
    off, and on CPU its projections prepacked for oneDNN (``prepack``). Draft models built apart take it too.
    ``after_weights`` sees the whole weights before any layer keeps a share of them or is packed (the KV scales,
    dummy weights rounded to FP8: pipeline/models/quantized_weights.py)."""
    if weights is None:
        initialize_dummy_weights(model)
    else:
        if isinstance(weights, CheckpointWeights):  # FP8 storage first where the stream keeps FP8 weights (GPU)
            weights.prepare(model)
        model.load_weights(weights)
    if after_weights is not None:
        after_weights(model)
    if hasattr(model, "after_load"):  # a model that keeps a share of its layers' heads (expert parallelism)
        model.after_load()
    model.eval()
    model.requires_grad_(False)
    if prepack and next(model.parameters()).device.type == "cpu":
        model.prepack()
    return model


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """--load-format dummy: random weights made on the device (benchmark any shape without files).

    Norm weights are 1 and projections N(0, 0.02), so activations stay finite through deep stacks."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
