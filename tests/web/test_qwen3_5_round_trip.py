"""The built-in Qwen3.5 template and the server's parsers agree: what a model writes in the template's format parses
(qwen3 reasoning + qwen3_coder tool calls) into the message that, rendered back, is exactly what it wrote."""
from __future__ import annotations

import json
from typing import Any

import pytest

from pipeline.chat_template import render_chat_template
from pipeline.templates import builtin_chat_template
from tests.web.chunking import chunkings
from web.chat_output import ChatOutputParser, ChatPiece
from web.reasoning import ReasoningSplitter
from web.tool_calls_qwen3_coder import Qwen3CoderToolCallParser

TEMPLATE = builtin_chat_template("qwen3_5.jinja")
SCHEMA = {"type": "object", "properties": {
    "path": {"type": "string"}, "code": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
    "force": {"type": "boolean"}, "parent": {"type": ["string", "null"]}, "options": {"type": "object"},
    "tags": {"type": "array"}, "zip": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("write_file", {"path": "src/main.rs", "code": "fn main() {\n    println!(\"<b>ü</b>\");\n}", "count": 3,
                    "ratio": 0.25, "force": True, "parent": None, "options": {"mode": "w", "n": [1, 2]},
                    "tags": ["a", "b"], "zip": "01234"}),
    ("noop", {}),
]
USER = [{"role": "user", "content": "Write the file."}]


def _assistant(reasoning: str | None, content: str, calls: list[tuple[str, dict]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls)]}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _emitted(prompt: str, transcript: str) -> str:
    """The model's own output: the rendered turn past the generation prompt, without <|im_end|>."""
    assert transcript.startswith(prompt) and transcript.endswith("<|im_end|>\n")
    return transcript[len(prompt):-len("<|im_end|>\n")]


def _parse(text: str, prompt: str, chunks: list[str] | None = None) -> tuple[ChatPiece, list]:
    parser = ChatOutputParser("qwen3", "qwen3_coder", TOOLS)
    opens = ReasoningSplitter.for_prompt("qwen3", prompt).in_reasoning
    piece = ChatPiece()
    for chunk in chunks or [text]:
        piece.extend(parser.feed(chunk, prompt_opens_thinking=opens))
    return piece.extend(parser.finish()), parser.calls


@pytest.mark.parametrize("thinking", [True, False])
def test_a_rendered_tool_call_turn_parses_back_to_the_same_message(thinking: bool) -> None:
    prompt = render_chat_template(TEMPLATE, USER, tools=TOOLS, enable_thinking=thinking)
    assert ReasoningSplitter.for_prompt("qwen3", prompt).in_reasoning is thinking  # output starts in the block
    reasoning = "The user wants a file.\nCall write_file." if thinking else ""
    message = _assistant(reasoning, "I'll write it.", CALLS)
    transcript = render_chat_template(TEMPLATE, USER + [message], tools=TOOLS, add_generation_prompt=False)
    emitted = _emitted(prompt, transcript)

    piece, calls = _parse(emitted, prompt)
    assert piece.reasoning.strip("\n") == reasoning
    assert piece.content.strip() == "I'll write it."
    assert [(call.name, json.loads(call.arguments)) for call in calls] == CALLS
    parsed = {"role": "assistant", "content": piece.content, "reasoning_content": piece.reasoning,
              "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                           "arguments": json.loads(c.arguments)}}
                             for c in calls]}
    assert render_chat_template(TEMPLATE, USER + [parsed], tools=TOOLS, add_generation_prompt=False) == transcript


def test_round_trip_holds_however_the_output_is_streamed() -> None:
    prompt = render_chat_template(TEMPLATE, USER, tools=TOOLS)
    message = _assistant("think", "", CALLS[:1])
    emitted = _emitted(prompt, render_chat_template(TEMPLATE, USER + [message], tools=TOOLS,
                                                    add_generation_prompt=False))
    whole, whole_calls = _parse(emitted, prompt)
    for chunks in chunkings(emitted, max_cuts=40):
        piece, calls = _parse(emitted, prompt, chunks)
        assert (piece.reasoning, piece.content) == (whole.reasoning, whole.content)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == CALLS[:1]


def test_the_tool_call_parser_alone_reads_the_rendered_calls() -> None:
    message = _assistant(None, "", CALLS)
    transcript = render_chat_template(TEMPLATE, USER + [message], add_generation_prompt=False)
    body = transcript[transcript.index("<tool_call>"):-len("<|im_end|>\n")]
    parser = Qwen3CoderToolCallParser(TOOLS)
    content = parser.feed(body).content + parser.finish().content
    assert content == ""
    assert [(call.name, json.loads(call.arguments)) for call in parser.calls] == CALLS
