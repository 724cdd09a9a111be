"""Per-request setup of a chat completion's output handling: which parsers split its text, and
the tool-call grammar that keeps its calls well-formed.

Tool calls are parsed when the request offers tools and tool_choice is not "none"; the format is
the server's --tool-call-parser (or its model family's default), or the one the chat template writes
(qwen3_coder when it uses `<parameter=`, else hermes). Reasoning is split when the server runs a
--reasoning-parser (or its model family has one; "none" turns it off).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from web.app import NO_REASONING_PARSER
from web.chat_output import ChatOutputParser
from web.protocol_errors import bad_request
from web.tool_call_parsers import default_tool_call_parser
from web.tool_grammar import tool_call_grammar

if TYPE_CHECKING:
    from web.app import ServerState
    from web.protocol_requests import ChatRequest


def chat_output_parsers(state: ServerState, request: ChatRequest) -> Callable[[], ChatOutputParser] | None:
    """A factory of per-choice parsers (None: plain content), after setting the tool grammar."""
    settings = state.settings
    reasoning = settings.reasoning_parser if settings.reasoning_parser != NO_REASONING_PARSER else None
    uses_tools = bool(request.tools) and request.tool_choice != "none"
    tool_parser = None
    if uses_tools:
        tool_parser = settings.tool_call_parser or default_tool_call_parser(state.ready_engine().renderer.chat_template)
        if settings.enforce_tool_grammar:
            if request.params.grammar is not None:
                raise bad_request("response_format / structured_outputs cannot be combined with tools unless "
                                  'tool_choice is "none"', "tool_choice")
            thinking = reasoning is not None and request.chat_template_kwargs.get("enable_thinking", True) is not False
            request.params.grammar = tool_call_grammar(tool_parser, request.tools, request.tool_choice,
                                                       request.parallel_tool_calls, thinking)
    if reasoning is None and tool_parser is None:
        return None
    tools = request.tools
    return lambda: ChatOutputParser(reasoning, tool_parser, tools)
