"""A scripted coding-agent session against the embedded SmolLM2 model: 10 turns with forced tool
choice (read_file, write_file, run), each result fed back as a tool message. Every turn must come
back without a protocol error, with schema-valid arguments; streaming and not, alternately."""
from __future__ import annotations

import json

import jsonschema
import openai

from tests.web.server_utils import LiveServer
from web.app import ServerSettings

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the project.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "maxLength": 40}},
                                          "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write a file of the project.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "maxLength": 40},
                                          "content": {"type": "string", "maxLength": 80}},
                                          "required": ["path", "content"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run", "description": "Run a shell command.",
                                      "parameters": {"type": "object", "properties": {
                                          "command": {"type": "string", "maxLength": 60},
                                          "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}},
                                          "required": ["command"], "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def fake_tool(name: str, arguments: dict) -> str:
    if name == "read_file":
        return f"# {arguments['path']}\nprint('hello')\n"
    if name == "write_file":
        return f"wrote {len(arguments['content'])} bytes to {arguments['path']}"
    return f"$ {arguments['command']}\nok"


def streamed_call(client: openai.OpenAI, **kwargs) -> tuple[str, dict, str]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] = (delta.function.name if delta.function else None) or entry["name"]
                entry["arguments"] += (delta.function.arguments if delta.function else "") or ""
            finish = choice.finish_reason or finish
    assert len(calls) == 1, calls
    call = calls[0]
    return call["id"], {"name": call["name"], "arguments": call["arguments"]}, finish


def test_ten_turn_agent_session_with_forced_tools(smollm_gguf_path):
    settings = ServerSettings(served_model_names=["smol"])
    with LiveServer(smollm_gguf_path, settings, dtype="auto", block_size=16, max_num_batched_tokens=512) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        messages: list[dict] = [
            {"role": "system", "content": "You are a coding agent. Use the tools to fix the failing test."},
            {"role": "user", "content": "The test in tests/test_app.py fails. Find out why and fix it."}]
        used = set()
        for turn in range(10):
            kwargs = dict(model="smol", messages=messages, tools=TOOLS, tool_choice="required",
                          parallel_tool_calls=False, max_tokens=96, temperature=0.7, seed=turn)
            if turn % 2:
                call_id, function, finish = streamed_call(client, **kwargs)
            else:
                reply = client.chat.completions.create(**kwargs).choices[0]
                assert len(reply.message.tool_calls) == 1
                call = reply.message.tool_calls[0]
                call_id, function, finish = call.id, {"name": call.function.name,
                                                      "arguments": call.function.arguments}, reply.finish_reason
            assert finish == "tool_calls", (turn, function)
            arguments = json.loads(function["arguments"])
            jsonschema.validate(arguments, SCHEMAS[function["name"]])
            used.add(function["name"])
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": function}]})
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": fake_tool(function["name"], arguments)})
        assert used  # the session ran; which tools the small model picks is its business
        final = client.chat.completions.create(model="smol", messages=messages, tools=TOOLS, tool_choice="none",
                                               max_tokens=16, temperature=0)
        assert final.choices[0].message.tool_calls is None
        stats = live.wait_idle()
        assert stats["kv_blocks"]["used"] == 0
