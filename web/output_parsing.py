"""The output event stream every API face renders: each choice's text split into reasoning, content and tool calls.

One `ChoiceParsers` per request keeps a streaming parser per choice (web/chat_output.py). Streamed and collected
responses go through the same parser, so they reassemble to the same pieces however the text was chunked. Without
a reasoning or tool-call parser configured, every delta is plain content.
"""
from __future__ import annotations

from collections.abc import Callable

from pipeline.request import FinishReason
from web.chat_output import ChatOutputParser, ChatPiece
from web.tool_calls import ToolCall


class ChoiceParsers:
    def __init__(self, new_parser: Callable[[], ChatOutputParser] | None) -> None:
        self.new_parser = new_parser
        self.parsers: dict[int, ChatOutputParser] = {}

    @property
    def enabled(self) -> bool:
        return self.new_parser is not None

    def parse(self, index: int, text: str, finished: bool, prompt_opens_thinking: bool) -> ChatPiece | None:
        """Reasoning / content / tool calls of a choice's new text (None: no parsing configured)."""
        if self.new_parser is None:
            return None
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = self.new_parser()
        piece = parser.feed(text, prompt_opens_thinking)
        return piece.extend(parser.finish()) if finished else piece

    def piece(self, index: int, text: str, finished: bool, prompt_opens_thinking: bool) -> ChatPiece:
        """Like parse, with plain content when no parser is configured."""
        piece = self.parse(index, text, finished, prompt_opens_thinking)
        return ChatPiece(content=text) if piece is None else piece

    def calls(self, index: int) -> list[ToolCall]:
        parser = self.parsers.get(index)
        return parser.calls if parser is not None else []

    def finish_reason(self, index: int, reason: FinishReason | None) -> FinishReason | str | None:
        """A choice that stopped after writing tool calls finished for "tool_calls"; a truncated one keeps "length"."""
        if reason is FinishReason.STOP and self.calls(index):
            return "tool_calls"
        return reason
