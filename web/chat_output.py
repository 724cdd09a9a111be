"""One chat choice's generated text, split for the client: reasoning, content and tool calls.

Reasoning is split off first, so tool-call markup written inside a thinking block stays reasoning
text: it is neither executed (no tool_calls entry) nor shown as content. The tool-call parser
then reads only the content. Both are streaming parsers whose results do not depend on how the
text was chunked, so a streamed response reassembles to the non-streamed one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from web.reasoning import ReasoningSplitter
from web.tool_call_parsers import make_tool_call_parser
from web.tool_calls import ToolCall, ToolCallDelta, ToolCallParser


@dataclass(slots=True)
class ChatPiece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ChatPiece) -> ChatPiece:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ChatOutputParser:
    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None, tools: list[dict] | None) -> None:
        self.reasoning_parser = reasoning_parser
        self.splitter: ReasoningSplitter | None = None
        self.tools: ToolCallParser | None = make_tool_call_parser(tool_call_parser, tools) if tool_call_parser else None

    def feed(self, text: str, prompt_opens_thinking: bool = False) -> ChatPiece:
        if self.reasoning_parser is not None and self.splitter is None:
            self.splitter = ReasoningSplitter(in_reasoning=prompt_opens_thinking)
        if self.splitter is None:
            return self._content(text)
        reasoning, content = self.splitter.feed(text)
        return ChatPiece(reasoning=reasoning).extend(self._content(content))

    def finish(self) -> ChatPiece:
        piece = ChatPiece()
        if self.splitter is not None:
            reasoning, content = self.splitter.finish()
            piece.reasoning = reasoning
            piece.extend(self._content(content))
        if self.tools is not None:
            done = self.tools.finish()
            piece.extend(ChatPiece(content=done.content, tool_calls=done.tool_calls))
        return piece

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def _content(self, text: str) -> ChatPiece:
        if self.tools is None or not text:
            return ChatPiece(content=text)
        parsed = self.tools.feed(text)
        return ChatPiece(content=parsed.content, tool_calls=parsed.tool_calls)


def wire_tool_call_delta(delta: ToolCallDelta) -> dict:
    """OpenAI's stream shape: id, type and name on a call's first delta only."""
    function: dict = {"arguments": delta.arguments}
    out: dict = {"index": delta.index, "function": function}
    if delta.id is not None:
        out["id"] = delta.id
        out["type"] = "function"
    if delta.name is not None:
        function["name"] = delta.name
    return out


def wire_tool_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
