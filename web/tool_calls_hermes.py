"""Hermes-style tool calls (Qwen2.5, Qwen3, SmolLM2): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

The body goes through a strict incremental JSON scanner, one character at a time, so "well-formed so far" is exact:
the call is announced the moment its "name" string closes, and the characters of an "arguments" object are streamed
as they arrive (any argument text read before the name is sent with the first delta).

`ToolCall.arguments` is the model's own text of the "arguments" value, without surrounding whitespace, except that
raw control characters inside its strings (models write literal newlines in code) are sent as JSON escapes, so it is
strict JSON. An "arguments" that is a JSON string holding an object is sent re-serialized (json.dumps, ensure_ascii
off) when the string closes; a missing "arguments" gives "{}"; other top-level keys are ignored. The call breaks
(tool_calls.py says what follows) at the first character that makes the body invalid JSON, or not an object, or
that gives "name" a non-string or empty value, "arguments" a value other than an object or such a string, or either
key twice; a body that closes without a "name" breaks at its final "}". An announced call that is cut off keeps the
argument text streamed so far, which may be incomplete JSON, as OpenAI's own is with finish_reason "length"; "{}" if
none had been streamed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from web.tool_calls import ToolCallParser

_WS = " \t\n\r"
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# Number grammar: state -> {character class -> next state}; a number may end only in _NUMBER_ENDS.
_NUMBER = {
    "-": {"0": "0", "d": "int"},
    "0": {".": ".", "e": "e"},
    "int": {"0": "int", "d": "int", ".": ".", "e": "e"},
    ".": {"0": "frac", "d": "frac"},
    "frac": {"0": "frac", "d": "frac", "e": "e"},
    "e": {"s": "e+", "0": "exp", "d": "exp"},
    "e+": {"0": "exp", "d": "exp"},
    "exp": {"0": "exp", "d": "exp"},
}
_NUMBER_ENDS = ("0", "int", "frac", "exp")


def _char_class(ch: str) -> str:
    if ch in "123456789":
        return "d"
    return "e" if ch in "eE" else "s" if ch in "+-" else ch


@dataclass(slots=True)
class JsonScanner:
    """Strict incremental JSON checker: push() one character, False once the text can no longer be valid JSON.

    Raw control characters inside strings are let through (json.loads(strict=False) semantics): models write them.
    """
    stack: list[str] = field(default_factory=list)  # open containers: "{" or "["
    expect: str = "value"  # value, value_or_end, key, key_or_end, colon, comma_or_end, done
    token: str = ""  # the scalar being read: "", "str", "num" or "lit"
    state: str = ""  # a number's grammar state, or the rest of a literal
    escape: int = 0  # in a string: 0; 1 after a backslash; 2..5 while reading \\u hex digits
    key: bool = False  # the open string is an object key

    def push(self, ch: str) -> bool:
        if self.token == "str":
            return self._string(ch)
        if self.token == "lit":
            if ch != self.state[0]:
                return False
            self.state = self.state[1:]
            if not self.state:
                self._value_done()
            return True
        if self.token == "num":
            nxt = _NUMBER[self.state].get(_char_class(ch))
            if nxt is not None:
                self.state = nxt
                return True
            if self.state not in _NUMBER_ENDS:
                return False
            self._value_done()  # the number ended; `ch` is read as what follows it
        return ch in _WS or self._structure(ch)

    def _value_done(self) -> None:
        self.token = ""
        self.expect = "comma_or_end" if self.stack else "done"

    def _string(self, ch: str) -> bool:
        if self.escape == 1:
            if ch == "u":
                self.escape = 2
            elif ch in '"\\/bfnrt':
                self.escape = 0
            else:
                return False
        elif self.escape:
            if ch not in _HEX:
                return False
            self.escape = 0 if self.escape == 5 else self.escape + 1
        elif ch == "\\":
            self.escape = 1
        elif ch == '"':
            if self.key:
                self.token, self.expect = "", "colon"
            else:
                self._value_done()
        return True

    def _close(self, ch: str) -> bool:
        if not self.stack or ch != ("}" if self.stack[-1] == "{" else "]"):
            return False
        self.stack.pop()
        self._value_done()
        return True

    def _structure(self, ch: str) -> bool:
        expect = self.expect
        if expect == "colon":
            if ch == ":":
                self.expect = "value"
            return ch == ":"
        if expect == "comma_or_end":
            if ch == ",":
                self.expect = "key" if self.stack[-1] == "{" else "value"
                return True
            return self._close(ch)
        if expect in ("key", "key_or_end"):
            if ch == '"':
                self.token, self.key = "str", True
                return True
            return expect == "key_or_end" and self._close(ch)
        if expect == "value_or_end" and ch == "]":
            return self._close(ch)
        if expect not in ("value", "value_or_end"):
            return False
        if ch == '"':
            self.token, self.key = "str", False
        elif ch in "{[":
            self.stack.append(ch)
            self.expect = "key_or_end" if ch == "{" else "value_or_end"
        elif ch in _LITERALS:
            self.token, self.state = "lit", _LITERALS[ch]
        elif ch in "-0123456789":
            self.token, self.state = "num", "int" if ch in "123456789" else ch
        else:
            return False
        return True


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


class HermesToolCallParser(ToolCallParser):
    """`<tool_call>` + a JSON object with "name" and "arguments" + `</tool_call>`; arguments stream as written."""

    __slots__ = ("_json", "_key", "_string", "_args", "_has_args", "_pending")

    def _begin(self) -> None:
        self._json = JsonScanner()
        self._key = ""  # the top-level key whose value is being read
        self._string: list[str] = []  # a top-level string (key or value) being read, quotes included
        self._args = ""  # "{" while an "arguments" object streams, '"' while an "arguments" string is read
        self._has_args = False
        self._pending: list[str] = []  # argument text read before the name was known

    def _step(self, ch: str) -> bool:
        scanner = self._json
        depth, in_string = len(scanner.stack), scanner.token == "str"
        if depth == 0 and scanner.expect == "value" and ch not in _WS and ch != "{":
            return False  # the body must be an object
        starts_value = depth == 1 and scanner.expect == "value" and not scanner.token and ch not in _WS
        if not scanner.push(ch):
            return False
        if starts_value and self._key == "arguments":
            if self._has_args or ch not in '{"':
                return False
            self._has_args, self._args = True, ch
        elif starts_value and self._key == "name" and (self._id is not None or ch != '"'):
            return False
        if self._args == "{":
            self._put(json.dumps(ch)[1:-1] if in_string and ch < " " else ch)
            if len(scanner.stack) == 1:
                self._args = ""
            return True
        if depth == 1 and (in_string or scanner.token == "str"):
            if not in_string:
                self._string = []
            self._string.append(ch)
            if in_string and scanner.token != "str":
                return self._top_string(json.loads("".join(self._string), strict=False))
        if depth == 1 and not scanner.stack:  # the body closed
            if self._id is None:
                return False
            if not self._has_args:
                self._emit("{}")
            self._complete()
        return True

    def _top_string(self, text: str) -> bool:
        """A top-level string closed: a key, the name, or string-encoded arguments."""
        if self._json.expect == "colon":
            self._key = text
        elif self._key == "name":
            if not text.strip():
                return False
            self._announce(text.strip(), "".join(self._pending))
        elif self._key == "arguments":
            self._args = ""
            try:
                value = json.loads(text, strict=False, parse_constant=_no_constants)
            except ValueError:
                return False
            if not isinstance(value, dict):
                return False
            self._put(json.dumps(value, ensure_ascii=False))
        return True

    def _put(self, fragment: str) -> None:
        if self._id is None:
            self._pending.append(fragment)
        else:
            self._emit(fragment)

    def _cut(self) -> str:
        return "" if self._parts else "{}"
