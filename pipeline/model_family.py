"""Serving defaults by model family: the tool-call and reasoning parsers, and a built-in chat template.

A family's output format is fixed by its training, so the right parsers follow from config.json: Qwen3.5 and
Qwen3-Next write `<function=...><parameter=...>` tool calls and open `<think>` in the generation prompt. Making
those the defaults means a plain `conveyor serve --model DIR` parses them; an explicit flag still wins (the
server's settings apply these in `ServerSettings.with_model_defaults`). The facts are the family's registry entry
(pipeline/models/registry.py); this module reads them for a config.json.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.models.loader import load_hf_config, resolve_model_path
from pipeline.models.registry import FAMILY_BY_MODEL_TYPE
from pipeline.templates import builtin_chat_template


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
    """The defaults of the first family entry that serves one of the config's model types; a type no entry
    serves gives none (the generic behaviour)."""
    for model_type in model_types(hf_config):
        family = FAMILY_BY_MODEL_TYPE.get(model_type)
        if family is not None:
            return FamilyDefaults(family.tool_call_parser, family.reasoning_parser, family.chat_template)
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
