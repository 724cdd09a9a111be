"""Model registry keyed by HF ``model_type``; ``build_model`` constructs and loads a model."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pipeline.models.config import ModelArchConfig
from pipeline.models.llama import LlamaForCausalLM
from pipeline.models.quantized_weights import CheckpointWeights
from pipeline.models.qwen3_moe import Qwen3MoeForCausalLM
from pipeline.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    # hybrid Gated DeltaNet + gated attention (multimodal configs resolve to their *_text language model)
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5": Qwen3NextForCausalLM,
    "qwen3_5_text": Qwen3NextForCausalLM,
    "qwen3_5_moe": Qwen3NextForCausalLM,
    "qwen3_5_moe_text": Qwen3NextForCausalLM,
}


def get_model_class(model_type: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


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
