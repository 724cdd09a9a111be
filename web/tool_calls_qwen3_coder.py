"""Qwen3-Coder tool calls: XML-like markup whose parameter values are raw text, typed by the tool's JSON schema.

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

The call is announced when `<function=NAME>` closes. A parameter is sent whole when its `</parameter>` arrives:
`{"key": value` for the first, `, "key": value` for each next, and `}` at `</function>` ("{}" with no parameters), so
the fragments add up to exactly json.dumps(arguments, ensure_ascii=False). The value is the text between the tags
without surrounding whitespace (the tool-call grammar treats that whitespace as layout, so the parser must too),
typed by coerce_value; it ends only at `</parameter>`, so it may hold any
other markup. Whitespace between tags is ignored; any other text there, an empty name, or "<" or a newline inside a
name breaks the call (tool_calls.py says what follows). A repeated parameter keeps its first value. An announced call
that is cut off is closed with "}" ("{}" if no parameter completed): its arguments are the parameters completed so
far, a valid object; an unfinished parameter is dropped.
"""
from __future__ import annotations

import json
import math
import re

from web.tool_calls import ToolCallParser

_FUNCTION, _PARAMETER = "<function=", "<parameter="
_END_PARAMETER, _END_FUNCTION = "</parameter>", "</function>"
_INTEGER = re.compile(r"[-+]?[0-9]+")
_NUMBER = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")
_FAIL = object()


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows")
    return value


def _not_json(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> object:
    """json.loads, or _FAIL: NaN, Infinity and numbers that overflow to them are refused (json.dumps would write
    them as non-JSON)."""
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except (ValueError, RecursionError):
        return _FAIL


def _as_type(raw: str, kind: object) -> object:
    """`raw` as one JSON-schema type, or _FAIL where it does not fit."""
    text = raw.strip()
    if kind == "string":
        return raw
    if kind == "integer":
        return int(text) if _INTEGER.fullmatch(text) else _FAIL
    if kind == "number":
        if _INTEGER.fullmatch(text):
            return int(text)
        return float(text) if _NUMBER.fullmatch(text) and math.isfinite(float(text)) else _FAIL
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _FAIL)
    if kind == "null":
        return None if text.lower() == "null" else _FAIL
    if kind in ("object", "array"):
        return _loads(text)
    return _FAIL


def coerce_value(raw: str, schema: object) -> object:
    """Type a parameter's raw text by its schema ("type" may be a list; "string" is tried last).

    Without a usable type, or where the text fits none: the JSON value it spells, else the text itself.
    """
    kinds = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kinds, str):
        kinds = [kinds]
    if isinstance(kinds, list):
        for kind in sorted(kinds, key=lambda kind: kind == "string"):
            value = _as_type(raw, kind)
            if value is not _FAIL:
                return value
    value = _loads(raw.strip())
    return raw if value is _FAIL else value


def parameter_schemas(tools: list[dict]) -> dict[str, dict]:
    """Function name -> its parameters' `properties` (name -> schema), from an OpenAI `tools` list."""
    out: dict[str, dict] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        out[function["name"]] = properties if isinstance(properties, dict) else {}
    return out


class Qwen3CoderToolCallParser(ToolCallParser):
    """`<function=NAME>` with `<parameter=KEY>` children; each parameter is sent, typed, when it closes."""

    __slots__ = ("_schemas", "_state", "_text", "_key", "_seen")

    def __init__(self, tools: list[dict] | None) -> None:
        ToolCallParser.__init__(self, tools)
        self._schemas = parameter_schemas(self.tools)
        self._begin()

    def _begin(self) -> None:
        self._state = "start"  # start (wants <function=), name, body (wants <parameter= or </function>), key, value
        self._text: list[str] = []  # the tag, name or value being read
        self._key = ""
        self._seen: set[str] = set()  # parameters sent

    def _step(self, ch: str) -> bool:
        state = self._state
        if state == "value":
            self._text.append(ch)
            if ch == ">" and "".join(self._text[-len(_END_PARAMETER):]) == _END_PARAMETER:
                self._parameter("".join(self._text[:-len(_END_PARAMETER)]))
                self._state, self._text = "body", []
            return True
        if state in ("name", "key"):
            if ch != ">":
                self._text.append(ch)
                return ch not in "<\n"
            name, self._text = "".join(self._text).strip(), []
            if not name:
                return False
            if state == "name":
                self._announce(name)
                self._state = "body"
            else:
                self._key, self._state = name, "value"
            return True
        if not self._text and ch.isspace():
            return True
        self._text.append(ch)
        tag = "".join(self._text)
        wanted = (_FUNCTION,) if state == "start" else (_PARAMETER, _END_FUNCTION)
        if not any(w.startswith(tag) for w in wanted):
            return False
        if tag in wanted:
            self._text = []
            if tag == _END_FUNCTION:
                self._emit(self._cut())
                self._complete()
            else:
                self._state = "name" if tag == _FUNCTION else "key"
        return True

    def _parameter(self, raw: str) -> None:
        raw = raw.strip()  # whitespace around a value is not part of it (as in xgrammar's qwen_xml grammar)
        if self._key in self._seen:
            return
        value = coerce_value(raw, self._schemas.get(self._name, {}).get(self._key))
        self._emit(f"{', ' if self._seen else '{'}{json.dumps(self._key, ensure_ascii=False)}: "
                   f"{json.dumps(value, ensure_ascii=False)}")
        self._seen.add(self._key)

    def _cut(self) -> str:
        return "}" if self._seen else "{}"
