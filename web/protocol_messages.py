"""Chat messages, tools and tool_choice: validated and normalized for the chat template.

The output is what transformers' `apply_chat_template` expects: text content as a string (text
parts joined with "\\n", as vLLM does for text-only models) and assistant tool-call arguments as
objects (templates iterate `arguments | items`). Other message keys pass through untouched.
"""
from __future__ import annotations

import orjson

from web.protocol_errors import bad_request
from web.protocol_fields import show

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
TOOL_CHOICE_MODES = ("none", "auto", "required")
_TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "refusal": "refusal"}


def normalize_messages(raw: object) -> list[dict]:
    if raw is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(raw, list):
        raise bad_request(f"messages must be a list of message objects, got {show(raw)}", "messages")
    if not raw:
        raise bad_request("messages must not be empty", "messages")
    return [_normalize_message(message, f"messages[{i}]") for i, message in enumerate(raw)]


def _normalize_message(message: object, where: str) -> dict:
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object, got {show(message)}", where)
    role = message.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}; got {show(role)}", f"{where}.role")
    out = dict(message)
    out["content"] = _content_text(message.get("content"), role, f"{where}.content")
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise bad_request(f"{where}.{key} must be a string, got {show(message[key])}", f"{where}.{key}")
    if message.get("tool_calls") is not None:
        out["tool_calls"] = _normalize_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    return out


def _content_text(content: object, role: str, where: str) -> str | None:
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":  # content may be null beside tool_calls (or a bare prefill turn)
            return None
        raise bad_request(f"{where} is required for role {show(role)}", where)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            part_where = f"{where}[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _TEXT_PART_FIELDS:
                raise bad_request(f"{part_where}: content part type {show(kind)} is not supported; this server "
                                  "serves text-only models and accepts only 'text' parts", part_where)
            text = part.get(_TEXT_PART_FIELDS[kind])
            if not isinstance(text, str):
                raise bad_request(f"{part_where}.{_TEXT_PART_FIELDS[kind]} must be a string, got {show(text)}",
                                  part_where)
            texts.append(text)
        return "\n".join(texts)
    raise bad_request(f"{where} must be a string, a list of content parts, or null; got {show(content)}", where)


def _normalize_tool_calls(raw: object, where: str) -> list[dict]:
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be a list, got {show(raw)}", where)
    calls = []
    for k, call in enumerate(raw):
        call_where = f"{where}[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{call_where} must be an object with function.name, got {show(call)}", call_where)
        function = dict(function)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            function["arguments"] = _arguments_object(arguments)
        calls.append({**call, "function": function})
    return calls


def _arguments_object(arguments: str) -> dict | str:
    """JSON-object arguments become a dict for the template; anything else stays the original string.

    A malformed historical call (e.g. one cut off by max_tokens) should not make the whole
    conversation unservable; templates that accept string arguments still render it.
    """
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def validate_tools(raw: object) -> list[dict] | None:
    """Tools pass to the template exactly as sent (serialization must match transformers' tojson).

    An empty list means no tools: OpenAI rejects `[]`, and templates test `tools is not none`.
    """
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request(f"tools must be a list of tool objects, got {show(raw)}", "tools")
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"{where} must be an object with type 'function', got {show(tool)}", where)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"{where}.function must be an object with a non-empty name, got {show(function)}",
                              f"{where}.function")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object, "
                              f"got {show(function['parameters'])}", f"{where}.function.parameters")
    return raw or None


def validate_tool_choice(raw: object, tools: list[dict] | None) -> object:
    """"none" / "auto" / "required" / {"type": "function", "function": {"name": ...}}.

    Defaults as OpenAI's: "auto" with tools, "none" without.
    """
    if raw is None:
        return "auto" if tools else "none"
    if isinstance(raw, str):
        if raw not in TOOL_CHOICE_MODES:
            raise bad_request(f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or a named function; "
                              f"got {show(raw)}", "tool_choice")
        if raw == "required" and not tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return raw
    function = raw.get("function") if isinstance(raw, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or raw.get("type", "function") != "function":
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                          f'"function": {{"name": ...}}}}; got {show(raw)}', "tool_choice")
    names = [tool["function"]["name"] for tool in tools or []]
    if name not in names:
        raise bad_request(f"tool_choice names function {show(name)}, which is not in tools", "tool_choice")
    return raw
