"""Serving defaults by model family (pipeline/model_family.py) and the chat template a model is served with."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.loading import model_chat_template
from pipeline.model_family import (NO_DEFAULTS, FamilyDefaults, family_chat_template, family_defaults,
                                   model_family_defaults, model_types)
from pipeline.templates import builtin_chat_template
from pipeline.tokenizer import Tokenizer

QWEN3_5 = FamilyDefaults(tool_call_parser="qwen3_coder", reasoning_parser="qwen3", chat_template="qwen3_5.jinja")


# the Qwen3.5 / Qwen3-Next types (the *_text ones are a multimodal config's text_config)
QWEN3_5_FAMILY = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


@pytest.mark.parametrize("model_type", QWEN3_5_FAMILY)
def test_qwen3_5_family_defaults(model_type: str) -> None:
    assert family_defaults({"model_type": model_type}) == QWEN3_5


def test_multimodal_config_is_read_through_text_config() -> None:
    config = {"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 8}}
    assert model_types(config) == ("qwen3_5_moe_text", "qwen3_5_moe")
    assert family_defaults(config) == QWEN3_5
    assert family_defaults({"model_type": "some_wrapper", "text_config": {"model_type": "qwen3_5_text"}}) == QWEN3_5


@pytest.mark.parametrize("config", [{"model_type": "llama"}, {"model_type": "qwen3"}, {"model_type": "qwen3_moe"}, {},
                                    {"model_type": "llava", "text_config": {"model_type": "llama"}}])
def test_other_families_have_no_defaults(config: dict) -> None:
    assert family_defaults(config) == NO_DEFAULTS
    assert family_chat_template(config) is None


def test_family_chat_template_is_the_packaged_file() -> None:
    template = family_chat_template({"model_type": "qwen3_5_moe"})
    assert template == builtin_chat_template("qwen3_5.jinja")
    assert "<parameter=" in template and "<tool_response>" in template


def _model_dir(directory: Path, tokenizer_files: Path, config: dict, with_template: bool) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json") + (("chat_template.jinja",) if with_template else ()):
        (directory / name).write_bytes((tokenizer_files / name).read_bytes())
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_model_family_defaults_reads_only_config_json(tmp_path: Path, tokenizer_files: Path) -> None:
    qwen = _model_dir(tmp_path / "qwen", tokenizer_files, {"model_type": "qwen3_5_moe"}, with_template=False)
    llama = _model_dir(tmp_path / "llama", tokenizer_files, {"model_type": "llama"}, with_template=True)
    assert model_family_defaults(str(qwen)) == QWEN3_5
    assert model_family_defaults(str(llama)) == NO_DEFAULTS
    assert model_family_defaults(str(tmp_path / "missing")) == NO_DEFAULTS  # loading reports it, not this


def test_served_template_tokenizer_first_then_family(tmp_path: Path, tokenizer_files: Path) -> None:
    config = {"model_type": "qwen3_5_moe"}
    bare = _model_dir(tmp_path / "bare", tokenizer_files, config, with_template=False)
    shipped = _model_dir(tmp_path / "shipped", tokenizer_files, config, with_template=True)
    assert model_chat_template(None, Tokenizer.from_pretrained(str(bare)), config) == builtin_chat_template(
        "qwen3_5.jinja")
    own = Tokenizer.from_pretrained(str(shipped))
    assert own.chat_template and model_chat_template(None, own, config) == own.chat_template
    assert model_chat_template("{{ 'override' }}", own, config) == "{{ 'override' }}"
    assert model_chat_template(None, Tokenizer.from_pretrained(str(bare)), {"model_type": "llama"}) is None
