"""The tool-call formats the server parses (``--tool-call-parser``), by name, and the one a chat template implies.

Each format is a ``ToolCallParser`` subclass in a module of its own, over the base class in tool_calls.py; this
module names them all, so the base class imports no format and every import order finds the same parsers.
"""
from __future__ import annotations

from web.tool_calls import ToolCallParser
from web.tool_calls_hermes import HermesToolCallParser
from web.tool_calls_qwen3_coder import Qwen3CoderToolCallParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesToolCallParser,
                                                      "qwen3_coder": Qwen3CoderToolCallParser}


def make_tool_call_parser(name: str, tools: list[dict] | None) -> ToolCallParser:
    cls = TOOL_CALL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of: {', '.join(sorted(TOOL_CALL_PARSERS))}")
    return cls(tools)


def default_tool_call_parser(chat_template: str | None) -> str:
    """Qwen3-Coder templates describe `<parameter=...>` markup; everything else gets the hermes JSON format."""
    return "qwen3_coder" if chat_template and "<parameter=" in chat_template else "hermes"
