"""Streaming tool-call extraction: shared types and the parser base class (the formats: tool_call_parsers.py).

A model asks for a tool by writing markup into its output. A parser turns that text stream into OpenAI's shape, plain
`content` plus `tool_calls` deltas, chunk by chunk, so the server can stream both. The format-specific subclasses
(tool_calls_hermes.py, tool_calls_qwen3_coder.py) read only a call's body, one character at a time; this base class
does the framing. The concatenated content, the completed calls and each call's concatenated argument fragments are
the same however the text is split into feed() calls.

Policy, the same for every format:

* Text outside a call is content, verbatim. A suffix that may still become `<tool_call>` is held back until decided,
  so the opening tag never reaches content. A whitespace-only stretch between two calls, or between a call and the end
  of the output, is dropped; every other piece of text, its whitespace included, is content.
* A call is *announced* (its first delta: index, id, name) only once its name is complete and every character of the
  call so far fits the format. Nothing of an unannounced call is sent. If it breaks (a character that cannot continue
  it) or the output ends inside it, it is no call: its raw text, from the whitespace-only stretch before
  `<tool_call>` on, becomes content (nothing the model wrote is lost) and plain-text scanning resumes at the character
  that broke it.
* An announced call is committed: it always ends up in `calls`, with `arguments` exactly its streamed fragments. If
  the output ends inside it (truncation) or a later character cannot continue it, it is closed as it stands, with the
  closing fragment its format gives (`_cut`), and the markup it had consumed is dropped; from the offending character
  on, the text is plain text again.
* A call is complete when its body closes. The `</tool_call>` after it, and whitespace before that, are consumed; a
  missing closing tag is tolerated, and a partial one at the very end of the output is dropped.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_TEXT, _BODY, _TAIL = 0, 1, 2  # outside calls; inside a call's body; after a body, awaiting </tool_call>


@dataclass(slots=True)
class ToolCallDelta:
    """One OpenAI streaming `tool_calls` entry; id and name ride only on a call's first delta."""
    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(slots=True)
class ToolCall:
    """A completed call, as a non-streaming response lists it under `message.tool_calls`."""
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ParsedText:
    """What one feed()/finish() yields: content that is safe to send now, and tool-call deltas."""
    content: str
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: text that may still become the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """Frames calls between `<tool_call>` and `</tool_call>`; subclasses read the body via _begin/_step/_cut."""

    __slots__ = ("tools", "calls", "_mode", "_held", "_after_call", "_raw", "_id", "_name", "_parts", "_content",
                 "_deltas")

    def __init__(self, tools: list[dict] | None) -> None:
        self.tools: list[dict] = tools or []
        self.calls: list[ToolCall] = []
        self._mode = _TEXT
        self._held = ""  # text mode: the undecided suffix; tail mode: whitespace + a partial closing tag
        self._after_call = False  # right after a call: a whitespace-only stretch is held, then dropped or kept
        self._raw: list[str] = []  # the unannounced call's text so far, content again if it breaks
        self._id: str | None = None  # the current call's id once it is announced
        self._name = ""
        self._parts: list[str] = []  # the current call's streamed argument fragments
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    def feed(self, text: str) -> ParsedText:
        """Take the next chunk of generated text (any split, even one character)."""
        while text:
            if self._mode == _TEXT:
                text = self._scan_text(text)
            elif self._mode == _BODY:
                text = self._scan_body(text)
            else:
                text = self._scan_tail(text)
        return self._take()

    def finish(self) -> ParsedText:
        """End of output: flush held text; an unannounced call is content, an announced one is closed."""
        if self._mode == _BODY:
            if self._id is None:
                self._content.append("".join(self._raw))
            else:
                self._close(self._cut())
        elif self._mode == _TEXT and not (self._after_call and self._held.isspace()):
            self._content.append(self._held)
        self._held, self._raw, self._mode = "", [], _TEXT  # tail mode: a partial closing tag is dropped
        return self._take()

    # ---- hooks for a format: the body of one call, one character at a time ----------------------------------------

    def _begin(self) -> None:
        """Reset per-call state; called right after `<tool_call>`."""

    def _step(self, ch: str) -> bool:
        """Consume one body character; False if it cannot continue the call. Call _complete() when the body closes."""
        raise NotImplementedError

    def _cut(self) -> str:
        """The fragment that closes the arguments of an announced call that ends early."""
        return ""

    # ---- helpers for a format ---------------------------------------------------------------------------------------

    def _announce(self, name: str, arguments: str = "") -> None:
        self._id, self._name, self._raw = new_call_id(), name, []
        self._deltas.append(ToolCallDelta(len(self.calls), self._id, name, ""))
        self._emit(arguments)

    def _emit(self, fragment: str) -> None:
        """Stream an argument fragment of the announced call (merged into this feed's last delta for it)."""
        if not fragment:
            return
        self._parts.append(fragment)
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == len(self.calls):
            last.arguments += fragment
        else:
            self._deltas.append(ToolCallDelta(len(self.calls), None, None, fragment))

    def _complete(self) -> None:
        """The body closed normally: the call is done; what follows may be `</tool_call>`."""
        self._close()
        self._mode = _TAIL

    # ---- framing ----------------------------------------------------------------------------------------------------

    def _close(self, fragment: str = "") -> None:
        assert self._id is not None
        self._emit(fragment)
        self.calls.append(ToolCall(self._id, self._name, "".join(self._parts)))
        self._id, self._parts, self._after_call = None, [], True

    def _take(self) -> ParsedText:
        out = ParsedText("".join(self._content), self._deltas)
        self._content, self._deltas = [], []
        return out

    def _scan_text(self, text: str) -> str:
        buf, self._held = self._held + text, ""
        at = buf.find(OPEN_TAG)
        end = at if at >= 0 else len(buf) - partial_tag_len(buf, OPEN_TAG)
        head = buf[:end]
        hold = self._after_call and (not head or head.isspace())  # whitespace after a call: not decided yet
        if not hold:
            self._content.append(head)
            self._after_call = False
        if at < 0:
            self._held = buf if hold else buf[end:]
            return ""
        self._mode, self._after_call = _BODY, False
        self._raw, self._parts = [head if hold else "", OPEN_TAG], []
        self._begin()
        return buf[at + len(OPEN_TAG):]

    def _scan_body(self, text: str) -> str:
        for i, ch in enumerate(text):
            if not self._step(ch):
                if self._id is None:  # never announced: it is no call, and its text is content
                    self._content.append("".join(self._raw) + text[:i])
                    self._raw = []
                else:
                    self._close(self._cut())
                self._mode = _TEXT
                return text[i:]
            if self._mode != _BODY:
                return text[i + 1:]
        if self._id is None:
            self._raw.append(text)
        return ""

    def _scan_tail(self, text: str) -> str:
        held = self._held
        for i, ch in enumerate(text):
            matched = len(held.lstrip())
            if not matched and ch.isspace():
                held += ch
            elif ch == CLOSE_TAG[matched]:
                held += ch
                if matched + 1 == len(CLOSE_TAG):
                    self._held, self._mode = "", _TEXT
                    return text[i + 1:]
            else:  # no closing tag: the held text and the rest are plain text after the call
                self._held, self._mode = "", _TEXT
                return held + text[i:]
        self._held = held
        return ""
