"""A choice's parsed output as a sequence of items: reasoning, text and tool calls, each opened, extended and closed.

The Responses API (output items) and the Messages API (content blocks) both present output this way; both build it
from the same parsed pieces (web/output_parsing.py), streamed or collected, so a streamed answer reassembles to the
collected one. Invariants: at most one item is open at a time; an item's id is made once, when it opens, so the
stream and the final answer name it alike; a text item never opens on whitespace alone (whitespace that only
separates reasoning from a tool call is layout, not an answer).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from web.chat_output import ChatPiece

REASONING, TEXT, TOOL_CALL = "reasoning", "text", "tool_call"


@dataclass(slots=True)
class OutputItem:
    kind: str  # REASONING, TEXT or TOOL_CALL
    position: int  # its index among the choice's items
    id: str
    parts: list[str] = field(default_factory=list)  # reasoning text, answer text, or a call's argument fragments
    call_id: str | None = None  # TOOL_CALL: the parser's call id
    name: str | None = None  # TOOL_CALL: the function's name
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass(slots=True)
class ItemEvent:
    op: str  # "open", "delta" or "close"
    item: OutputItem
    text: str = ""  # "delta": the new text


class OutputItems:
    """Feeds parsed pieces, returns the item events they make; `items` is the answer so far."""

    def __init__(self, new_id: Callable[[str], str]) -> None:
        self.new_id = new_id  # kind -> a fresh item id in the face's style
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._pending_space = ""  # whitespace-only text that has not opened a text item yet
        self._calls: dict[int, OutputItem] = {}  # tool-call index -> its item

    def feed(self, piece: ChatPiece) -> list[ItemEvent]:
        events: list[ItemEvent] = []
        if piece.reasoning:
            self._append(REASONING, piece.reasoning, events)
        if piece.content:
            self._text(piece.content, events)
        for delta in piece.tool_calls:
            if delta.id is not None:
                self._pending_space = ""
                self._close(events)
                item = self._start(TOOL_CALL, events, call_id=delta.id, name=delta.name)
                self._calls[delta.index] = item
            item = self._calls.get(delta.index)
            if item is not None and delta.arguments:
                item.parts.append(delta.arguments)
                events.append(ItemEvent("delta", item, delta.arguments))
        return events

    def finish(self) -> list[ItemEvent]:
        """The end of the choice: the open item closes."""
        events: list[ItemEvent] = []
        self._pending_space = ""
        self._close(events)
        return events

    def _text(self, text: str, events: list[ItemEvent]) -> None:
        if self._open is not None and self._open.kind == TEXT:
            self._append(TEXT, text, events)
        elif text.isspace():
            self._pending_space += text
        else:
            text, self._pending_space = self._pending_space + text, ""
            self._append(TEXT, text, events)

    def _append(self, kind: str, text: str, events: list[ItemEvent]) -> None:
        item = self._open
        if item is None or item.kind != kind:
            if kind != TEXT:
                self._pending_space = ""
            self._close(events)
            item = self._start(kind, events)
        item.parts.append(text)
        events.append(ItemEvent("delta", item, text))

    def _start(self, kind: str, events: list[ItemEvent], *, call_id: str | None = None,
               name: str | None = None) -> OutputItem:
        item = OutputItem(kind, len(self.items), self.new_id(kind), call_id=call_id, name=name)
        self.items.append(item)
        self._open = item
        events.append(ItemEvent("open", item))
        return item

    def _close(self, events: list[ItemEvent]) -> None:
        item, self._open = self._open, None
        if item is not None:
            item.done = True
            events.append(ItemEvent("close", item))
