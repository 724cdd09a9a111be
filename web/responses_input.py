"""Responses API input items -> chat messages, the conversation every face hands the engine.

Items: messages of any role (`developer` is a system prompt), `function_call` / `function_call_output` (output a
string or a list of text parts), `custom_tool_call` / `custom_tool_call_output` (a freeform call's input is its
`input` argument), and `reasoning` (its text becomes the next assistant turn's `reasoning_content`, which reasoning
templates render). An assistant's text and the calls that follow it form one assistant turn, as chat writes it. A
call output must answer a call made earlier in the conversation. Images, files and audio are refused: the served
models read text only.
"""
from __future__ import annotations

import base64

import orjson

from web.protocol_errors import bad_request
from web.protocol_fields import show

INPUT_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal",
               "summary_text": "text", "reasoning_text": "text"}
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
ENCRYPTED_PREFIX = "conveyor:"  # our reasoning items carry their text, base64, in encrypted_content


def encrypted_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def _decrypted_reasoning(value: object) -> str:
    """The text of a reasoning item's encrypted_content when this server wrote it; others' are opaque."""
    if not isinstance(value, str) or not value.startswith(ENCRYPTED_PREFIX):
        return ""
    try:
        return base64.b64decode(value[len(ENCRYPTED_PREFIX):], validate=True).decode()
    except ValueError:
        return ""


def input_items(raw: object) -> list[dict]:
    """`input` as a list of item objects (a string is one user message)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise bad_request(f"input must be a string or a list of input items, got {show(raw)}", "input")
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object, got {show(item)}", f"input[{i}]")
    return raw


def part_text(content: object, where: str) -> str:
    """A content value (a string or a list of text parts) as text; text parts join with a newline."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts, got {show(content)}", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise bad_request(f"{where}[{j}]: {kind} is not supported: the served model reads text only",
                              f"{where}[{j}]")
        field = _TEXT_PARTS.get(kind)  # type: ignore[arg-type]
        if field is None or not isinstance(part.get(field), str):
            raise bad_request(f"{where}[{j}] must be a text part (input_text, output_text), got {show(part)}",
                              f"{where}[{j}]")
        texts.append(part[field])
    return "\n".join(texts)


class _Conversation:
    """Chat messages under construction; an assistant turn stays open for the calls that follow its text."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.call_ids: set[str] = set()
        self.reasoning: list[str] = []  # reasoning items waiting for their assistant turn
        self._turn: dict | None = None  # the open assistant turn

    def add(self, message: dict) -> None:
        self._turn = None
        self.reasoning = []
        self.messages.append(message)

    def assistant_turn(self, text: str | None) -> dict:
        turn = self._turn
        if turn is None or (text is not None and turn.get("tool_calls")):
            turn = {"role": "assistant", "content": text}
            self.messages.append(turn)
        elif text is not None:
            turn["content"] = (turn["content"] or "") + text
        if self.reasoning:
            turn["reasoning_content"] = (turn.get("reasoning_content") or "") + "".join(self.reasoning)
            self.reasoning = []
        self._turn = turn
        return turn

    def call(self, call_id: str, name: str, arguments: str, where: str) -> None:
        turn = self.assistant_turn(None)
        turn.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        self.call_ids.add(call_id)

    def output(self, call_id: str, text: str, where: str) -> None:
        if call_id not in self.call_ids:
            raise bad_request(f"{where}: no tool call found for call output with call_id {show(call_id)}",
                              f"{where}.call_id")
        self.add({"role": "tool", "tool_call_id": call_id, "content": text})


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise bad_request(f"{where}.{key} must be a non-empty string, got {show(value)}", f"{where}.{key}")
    return value


def items_to_messages(items: list[dict], where: str = "input") -> list[dict]:
    conversation = _Conversation()
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise bad_request(f"{at}.role must be one of {', '.join(INPUT_ROLES)}; got {show(role)}",
                                  f"{at}.role")
            text = part_text(item.get("content"), f"{at}.content")
            if role == "assistant":
                conversation.assistant_turn(text)
            else:
                conversation.add({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            conversation.call(_string(item, "call_id", at), _string(item, "name", at),
                              _string(item, "arguments", at) or "{}", at)
        elif kind == "custom_tool_call":
            arguments = orjson.dumps({"input": _string(item, "input", at)}).decode()
            conversation.call(_string(item, "call_id", at), _string(item, "name", at), arguments, at)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            conversation.output(_string(item, "call_id", at), part_text(item.get("output"), f"{at}.output"), at)
        elif kind == "reasoning":
            conversation.reasoning.append(_reasoning_text(item, at))
        else:
            raise bad_request(f"{at}.type {show(kind)} is not supported; input items are messages, function_call, "
                              "function_call_output, custom_tool_call(_output) and reasoning", f"{at}.type")
    return conversation.messages


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its content, else what this server put in encrypted_content, else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            text = part_text(parts, f"{where}.{key}")
            if text:
                return text
        if key == "content":
            text = _decrypted_reasoning(item.get("encrypted_content"))
            if text:
                return text
    return ""
