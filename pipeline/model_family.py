"""Serving defaults by model family: the tool-call and reasoning parsers, and a built-in chat template.

A family's output format is fixed by its training, so the right parsers follow from config.json: Qwen3.5 and
Qwen3-Next write `<function=...><parameter=...>` tool calls and open `<think>` in the generation prompt. Making
those the defaults means a plain `conveyor serve --model DIR` parses them; an explicit flag still wins (the
server's settings apply these in `ServerSettings.with_model_defaults`). The table is `family_defaults`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.models.loader import load_hf_config, resolve_model_path
from pipeline.templates import builtin_chat_template

# HF model_type values of the Qwen3.5 / Qwen3-Next family (the *_text ones are a multimodal config's text_config).
QWEN3_5_FAMILY = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})


@dataclass(frozen=True, slots=True)
class FamilyDefaults:
    tool_call_parser: str | None = None  # None: the format the chat template writes
    reasoning_parser: str | None = None  # None: no reasoning split
    chat_template: str | None = None  # a packaged template (pipeline/templates/) for checkpoints without one


NO_DEFAULTS = FamilyDefaults()


def model_types(hf_config: dict[str, Any]) -> tuple[str, ...]:
    """The language model's type (a multimodal config keeps it in text_config), then the top-level type."""
    text_config = hf_config.get("text_config")
    found = (text_config.get("model_type") if isinstance(text_config, dict) else None, hf_config.get("model_type"))
    return tuple(t for t in found if isinstance(t, str) and t)


def family_defaults(hf_config: dict[str, Any]) -> FamilyDefaults:
    """The family -> defaults table; families not listed keep the generic behaviour."""
    types = model_types(hf_config)
    if any(t in QWEN3_5_FAMILY for t in types):
        return FamilyDefaults(tool_call_parser="qwen3_coder", reasoning_parser="qwen3", chat_template="qwen3_5.jinja")
    return NO_DEFAULTS


def family_chat_template(hf_config: dict[str, Any]) -> str | None:
    """The built-in template for a checkpoint whose tokenizer ships none (None: the family has none either)."""
    name = family_defaults(hf_config).chat_template
    return builtin_chat_template(name) if name else None


def model_family_defaults(model: str | None) -> FamilyDefaults:
    """Defaults for a model path as the CLI names it, read from its config alone (no weights, no tokenizer).

    Anything unreadable gives no defaults: loading the model reports the problem properly moments later.
    """
    try:
        return family_defaults(load_hf_config(resolve_model_path(model)))
    except (OSError, ValueError, KeyError):
        return NO_DEFAULTS
