"""Tool turns written as text for templates that know nothing of tools."""
from pipeline.tool_turns import inline_tool_turns, template_knows_tools


def test_tool_turns_become_hermes_text():
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}]
    out = inline_tool_turns(messages, tools)
    assert out[0]["role"] == "system" and '"name": "run"' in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>'}
    assert out[3] == {"role": "tool", "content": "<tool_response>\na.py\n</tool_response>"}
    assert all(isinstance(m["content"], str) for m in out)


def test_templates_that_mention_tools_are_left_alone():
    assert template_knows_tools("{% if tools %}...{% endif %}")
    assert not template_knows_tools("{{ message['content'] }}")
