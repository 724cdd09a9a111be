"""The grammar that makes tool calls well-formed by construction (xgrammar structural tags).

With tools offered, everything after a tool-call opener is constrained: the function name is one
of the offered tools and its arguments match that tool's parameter schema, so arguments always
parse. tool_choice decides what else is allowed:

- "auto": free text, with any number of calls (one with parallel_tool_calls=false) triggered by
  the opener;
- "required": only calls, at least one, from the first token;
- a named function: exactly one call of that function, from the first token.

With a reasoning parser and thinking on, a required or named call comes after the thinking block
(the block itself is free text). Markup written inside thinking is reasoning, never a call.

In the qwen3_coder (qwen_xml) style a top-level string parameter is raw text, and xgrammar turns its `maxLength`
into a bounded repetition whose token masks take seconds to precompute: about 1 s at 64 characters, 5-10 s from
about 200 up on two cores, for each such parameter. Claude Code's SendMessage (200) and Workflow (524288) alone
took its 24 tools past the 10 s --max-grammar-seconds. Such bounds up to QWEN_XML_MAX_LENGTH are kept; longer ones
are not enforced (the tool validates its own arguments). Hermes' JSON arguments keep every bound (they are cheap).
"""
from __future__ import annotations

import json
from typing import Any

from pipeline.grammar.spec import GrammarSpec

# Whitespace allowed between JSON tokens: room for indented arguments, none for a degenerate run of
# blank tokens (a weak model under a grammar otherwise fills its budget with whitespace).
MAX_WHITESPACE = 16
QWEN_XML_MAX_LENGTH = 64  # the longest maxLength of a top-level string parameter that qwen_xml enforces


def qwen_xml_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` without the maxLength bounds over QWEN_XML_MAX_LENGTH of its top-level properties (see above)."""
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return schema

    def long_bound(prop: object) -> bool:
        bound = prop.get("maxLength") if isinstance(prop, dict) else None
        return isinstance(bound, int) and not isinstance(bound, bool) and bound > QWEN_XML_MAX_LENGTH

    if not any(long_bound(prop) for prop in properties.values()):
        return schema
    relaxed = {name: {k: v for k, v in prop.items() if k != "maxLength"} if long_bound(prop) else prop
               for name, prop in properties.items()}
    return {**schema, "properties": relaxed}


def _tag(parser: str, function: dict[str, Any]) -> dict[str, Any]:
    name = function["name"]
    schema = function.get("parameters") or {"type": "object"}
    if parser == "qwen3_coder":
        return {"type": "tag", "begin": f"<tool_call>\n<function={name}>\n",
                "content": {"type": "json_schema", "json_schema": qwen_xml_schema(schema), "style": "qwen_xml",
                            "max_whitespace_cnt": MAX_WHITESPACE},
                "end": "\n</function>\n</tool_call>"}
    name_json = json.dumps(name, ensure_ascii=False)
    return {"type": "tag", "begin": f'<tool_call>\n{{"name": {name_json}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE},
            "end": "}\n</tool_call>"}


def tool_call_grammar(parser: str, tools: list[dict] | None, tool_choice: object, parallel_tool_calls: bool = True,
                      thinking: bool = False) -> GrammarSpec | None:
    """The structural tag for these tools and this tool_choice (None: nothing to enforce)."""
    if not tools or tool_choice == "none":
        return None
    functions = [tool["function"] for tool in tools]
    if isinstance(tool_choice, dict):
        wanted = tool_choice["function"]["name"]
        functions = [f for f in functions if f["name"] == wanted]
    tags = [_tag(parser, f) for f in functions]
    if tool_choice == "auto":
        calls: dict[str, Any] = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
                                 "at_least_one": False, "stop_after_first": not parallel_tool_calls}
    else:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                 "stop_after_first": isinstance(tool_choice, dict) or not parallel_tool_calls}
        if thinking:
            # begin "" so it holds whether the model or the prompt wrote the opening <think>
            think = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"}
            calls = {"type": "sequence", "elements": [think, {"type": "const_string", "value": "\n\n"}, calls]}
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": calls})
