"""The tool-call grammar's schemas: qwen_xml leaves long maxLength bounds of top-level strings out (their masks cost
seconds each to compile), so Claude Code 2.1.197's 24 tools compile well inside --max-grammar-seconds."""
from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.grammar.compiler import GrammarCompiler
from pipeline.tokenizer import Tokenizer
from web.messages_request import parse_messages_request
from web.tool_grammar import QWEN_XML_MAX_LENGTH, qwen_xml_schema, tool_call_grammar

FIXTURES = Path(__file__).parent / "fixtures"
SCHEMA = {"type": "object", "properties": {
    "short": {"type": "string", "maxLength": QWEN_XML_MAX_LENGTH},
    "long": {"type": "string", "maxLength": QWEN_XML_MAX_LENGTH + 1, "description": "kept"},
    "items": {"type": "array", "items": {"type": "string", "maxLength": 500}},
    "flag": {"type": "boolean"}}, "required": ["short"], "additionalProperties": False}


def tools(schema: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]


def test_qwen_xml_schema_leaves_out_only_long_top_level_bounds():
    relaxed = qwen_xml_schema(SCHEMA)
    assert relaxed["properties"]["long"] == {"type": "string", "description": "kept"}
    assert relaxed["properties"]["short"] == SCHEMA["properties"]["short"]
    assert relaxed["properties"]["items"] == SCHEMA["properties"]["items"]  # JSON inside the value: cheap
    assert {k: v for k, v in relaxed.items() if k != "properties"} == {
        k: v for k, v in SCHEMA.items() if k != "properties"}
    assert SCHEMA["properties"]["long"]["maxLength"] == QWEN_XML_MAX_LENGTH + 1  # the request's schema untouched
    assert qwen_xml_schema({"type": "object"}) == {"type": "object"}


def test_only_the_qwen3_coder_grammar_relaxes():
    def schema_in(parser: str) -> dict:
        source = json.loads(tool_call_grammar(parser, tools(SCHEMA), "auto").source)
        return source["format"]["tags"][0]["content"]["json_schema"]

    assert schema_in("hermes") == SCHEMA
    assert schema_in("qwen3_coder") == qwen_xml_schema(SCHEMA)


def test_claude_code_tools_compile_inside_the_grammar_time_limit(tokenizer_files):
    body = json.loads((FIXTURES / "claude_code_2.1.197_first_turn.json").read_text())
    chat = parse_messages_request(body).chat
    spec = tool_call_grammar("qwen3_coder", chat.tools, chat.tool_choice or "auto", True, thinking=True)
    sent = [prop.get("maxLength") for tool in body["tools"] for prop in tool["input_schema"]["properties"].values()]
    assert 200 in sent and 524288 in sent  # SendMessage.summary, Workflow.script
    compiled = [prop.get("maxLength") for tag in json.loads(spec.source)["format"]["tags"]
                for prop in tag["content"]["json_schema"].get("properties", {}).values()]
    assert all(bound is None or bound <= QWEN_XML_MAX_LENGTH for bound in compiled)
    compiler = GrammarCompiler(Tokenizer.from_pretrained(str(tokenizer_files)), 49152, [2])
    start = time.monotonic()
    compiler.compile_now(spec)
    # 0.5 s on two loaded cores; 9-16 s there with SendMessage's and Workflow's bounds (the limit is 10 s)
    assert time.monotonic() - start < 5.0
