"""Tool turns for chat templates that know nothing of tools (SmolLM2's, for one).

Such a template reads only `role` and `content`: an assistant turn that is all tool_calls has no
content to print (None breaks the template), and the tool list is never shown. So, only for those
templates, the turns are written as text in the hermes format before rendering: the tools as a
system message, each call as `<tool_call>{...}</tool_call>` in the assistant's content, and tool
results as `<tool_response>` blocks. Templates that mention tools render the messages untouched.
"""
from __future__ import annotations

import json
from typing import Any


def template_knows_tools(template: str) -> bool:
    return "tool" in template


def inline_tool_turns(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if tools:
        listing = "\n".join(json.dumps(tool.get("function", tool), ensure_ascii=False) for tool in tools)
        out.append({"role": "system", "content": (
            "You may call these tools. For each call, write <tool_call>\n{\"name\": ..., \"arguments\": ...}\n"
            f"</tool_call>.\n<tools>\n{listing}\n</tools>")})
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role == "assistant" and message.get("tool_calls"):
            calls = [f'<tool_call>\n{{"name": {json.dumps(c["function"]["name"], ensure_ascii=False)}, '
                     f'"arguments": {_arguments_text(c["function"].get("arguments"))}}}\n</tool_call>'
                     for c in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            content = f"<tool_response>\n{content or ''}\n</tool_response>"
        out.append({"role": role, "content": content or ""})
    return out


def _arguments_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
