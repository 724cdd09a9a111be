"""The configured drafter (``--speculative-method``), built once the target model is loaded (pipeline/loading.py).

It lives apart from the drafter interface (drafter.py), which every drafter implements and imports.
"""
from __future__ import annotations

import torch

from pipeline.config import EngineConfig
from pipeline.runner.model_runner import ModelRunner
from pipeline.spec.dflash import DFlashDrafter
from pipeline.spec.draft_model import DraftModelDrafter
from pipeline.spec.drafter import Drafter
from pipeline.spec.mtp import MtpDrafter
from pipeline.spec.ngram import NgramDrafter


def make_drafter(config: EngineConfig, runner: ModelRunner | None = None,
                 draft_model: torch.nn.Module | None = None) -> Drafter | None:
    """The configured drafter (None: no speculation). The model drafters draft with the target's runner (its caches,
    and the MTP head on its model) or a draft model whose caches follow the target's."""
    method = config.speculative_method
    if method is None:
        return None
    if method == "ngram":
        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    assert runner is not None
    if method == "mtp":
        return MtpDrafter(runner.model, runner, config.block_size)
    if method == "draft":
        assert draft_model is not None
        return DraftModelDrafter(draft_model, runner, len(runner.model.cache_specs(runner.dtype)), config.block_size)
    if method == "dflash":
        assert draft_model is not None
        return DFlashDrafter(draft_model, runner.model, runner, len(runner.model.cache_specs(runner.dtype)),
                             config.block_size)
    raise ValueError(f"unknown speculative_method {method!r}")
