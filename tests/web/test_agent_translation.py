"""The agent APIs' translations without a server: request bodies into chat requests, parsed output into items, and
Anthropic's error shape."""
from __future__ import annotations

import pytest

from web.chat_output import ChatPiece
from web.messages_errors import anthropic_error_body, anthropic_status
from web.messages_request import parse_messages_request
from web.output_items import REASONING, TEXT, TOOL_CALL, OutputItems
from web.protocol_errors import APIError
from web.responses_request import parse_responses_request
from web.tool_calls import ToolCallDelta


def test_items_open_close_and_skip_layout_whitespace():
    items = OutputItems(lambda kind: f"{kind}-id")
    events = items.feed(ChatPiece(reasoning="hmm"))
    events += items.feed(ChatPiece(content="\n\n"))
    events += items.feed(ChatPiece(tool_calls=[ToolCallDelta(0, "call_1", "f", ""), ToolCallDelta(0, None, None,
                                                                                                  '{"a": 1}')]))
    events += items.feed(ChatPiece(content="done"))
    events += items.finish()
    assert [(e.op, e.item.kind) for e in events] == [
        ("open", REASONING), ("delta", REASONING), ("close", REASONING), ("open", TOOL_CALL), ("delta", TOOL_CALL),
        ("close", TOOL_CALL), ("open", TEXT), ("delta", TEXT), ("close", TEXT)]
    assert [i.text for i in items.items] == ["hmm", '{"a": 1}', "done"]
    assert items.items[1].call_id == "call_1" and [i.position for i in items.items] == [0, 1, 2]


def test_responses_input_becomes_chat_turns():
    chat = parse_responses_request({
        "instructions": "Be brief.", "max_output_tokens": 9, "store": False,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "web_search"}],
        "input": [{"role": "developer", "content": "Sandbox."}, {"role": "user", "content": "hi"},
                  {"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text", "text": "think"}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
                  {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "r"}]}],
    }).chat
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[0]["content"] == "Be brief.\n\nSandbox."
    assistant = chat.messages[2]
    assert assistant["content"] == "ok" and assistant["reasoning_content"] == "think"
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert chat.messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "r"}
    assert [t["function"]["name"] for t in chat.tools] == ["f"] and chat.params.max_tokens == 9
    assert chat.params.max_tokens_clamped


def test_messages_body_becomes_chat_turns():
    chat = parse_messages_request({
        "model": "claude-x", "max_tokens": 50, "stop_sequences": ["END"],
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}, {"type": "text", "text": "Sys."}],
        "thinking": {"type": "enabled", "budget_tokens": 7},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}, {"type": "bash_20250124", "name": "bash"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [{"role": "system", "content": "More."}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                                       {"type": "tool_use", "id": "tu1", "name": "f", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "is_error": True,
                                                   "content": "boom"}, {"type": "text", "text": "and?"}]}],
    }).chat
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0]["content"] == "Sys.\n\nMore."
    assert chat.messages[2]["reasoning_content"] == "t" and chat.messages[3]["content"] == "Error: boom"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.params.stop == ["END"] and chat.params.thinking_token_budget == 7 and chat.params.max_tokens_clamped
    assert chat.chat_template_kwargs["enable_thinking"] is True and len(chat.tools) == 1


@pytest.mark.parametrize("status, kind, wire", [(503, "overloaded_error", 529), (400, "invalid_request_error", 400),
                                                (401, "authentication_error", 401), (504, "timeout_error", 504),
                                                (500, "api_error", 500)])
def test_anthropic_error_shapes(status, kind, wire):
    error = APIError(status, "nope")
    assert anthropic_status(error) == wire
    assert anthropic_error_body(error) == {"type": "error", "error": {"type": kind, "message": "nope"}}
