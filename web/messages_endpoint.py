"""The Anthropic Messages face of the generation core: content blocks and the `event:`-typed stream.

Blocks: thinking (with a signature, which this server only writes), text and tool_use, in the order the model wrote
them. The stream: `message_start` (input usage), `ping`, per block `content_block_start`, its deltas (text_delta,
thinking_delta then signature_delta, input_json_delta) and `content_block_stop`, then `message_delta` (stop_reason,
stop_sequence, output usage) and `message_stop`; or an `error` event, after which nothing follows. Usage counts the
prompt's cached tokens as cache reads, apart from input_tokens, as Anthropic does.
"""
from __future__ import annotations

import hashlib
import secrets
from typing import Any

import orjson

from pipeline.request import FinishReason, OutputDelta
from web.generation import Choice, Endpoint, Tracker
from web.messages_errors import anthropic_error_event
from web.output_items import REASONING, TEXT, ItemEvent, OutputItem, OutputItems
from web.output_parsing import ChoiceParsers
from web.protocol_errors import APIError


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def new_block_id(kind: str) -> str:
    return "toolu_" + secrets.token_hex(12) if kind == "tool_call" else ""


def thinking_signature(text: str) -> str:
    return "conveyor-" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def sse(kind: str, payload: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"


def tool_input(arguments: str) -> dict:
    """A call's arguments as an object ({} for a call cut off before its arguments closed)."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesEndpoint(Endpoint):
    api = "messages"

    def __init__(self, state: Any, model: str, parsers: ChoiceParsers) -> None:
        super().__init__(state, model, False, False)
        self.id = new_message_id()
        self.parsers = parsers
        self.blocks = OutputItems(new_block_id)
        self.failed = False

    def _usage(self, tracker: Tracker, output_tokens: int) -> dict:
        return {"input_tokens": tracker.prompt_tokens - tracker.cached_tokens, "output_tokens": output_tokens,
                "cache_read_input_tokens": tracker.cached_tokens, "cache_creation_input_tokens": 0}

    def _stop(self, tracker: Tracker) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence); a choice that did not end normally raises the error to report."""
        choice = tracker.choices.get(0) or Choice()
        reason = choice.finish_reason
        if reason is FinishReason.LENGTH:
            return "max_tokens", None
        if reason is FinishReason.STOP:
            if choice.stop_string is not None:
                return "stop_sequence", choice.stop_string
            return ("tool_use" if self.parsers.calls(0) else "end_turn"), None
        raise self._failure(choice)

    def _failure(self, choice: Choice) -> APIError:
        if choice.finish_reason is FinishReason.ERROR:
            return APIError(500, choice.error or "the request failed", "server_error")
        if self.state.engine is not None and self.state.engine.draining:
            return APIError(503, "the server is shutting down", "service_unavailable", code="server_shutting_down")
        return APIError(500, "the request was cancelled", "server_error")

    @staticmethod
    def block(item: OutputItem) -> dict:
        if item.kind == REASONING:
            return {"type": "thinking", "thinking": item.text, "signature": thinking_signature(item.text)}
        if item.kind == TEXT:
            return {"type": "text", "text": item.text}
        return {"type": "tool_use", "id": item.id, "name": item.name, "input": tool_input(item.text)}

    # ---- streaming ----------------------------------------------------------------------------------------------

    def opening(self, first: OutputDelta, n: int) -> bytes:
        usage = {"input_tokens": first.prompt_token_count - first.cached_prompt_tokens, "output_tokens": 0,
                 "cache_read_input_tokens": first.cached_prompt_tokens, "cache_creation_input_tokens": 0}
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage}
        return sse("message_start", {"message": message}) + sse("ping", {})

    def event(self, delta: OutputDelta, choice: Choice) -> bytes:
        finished = delta.finish_reason is not None
        piece = self.parsers.piece(delta.index, delta.text, finished, delta.prompt_opens_thinking)
        events = self.blocks.feed(piece)
        if finished:
            events += self.blocks.finish()
        return b"".join(self._render(event) for event in events) if events else b""

    def _render(self, event: ItemEvent) -> bytes:
        item = event.item
        index = {"index": item.position}
        if event.op == "open":
            if item.kind == REASONING:
                start: dict = {"type": "thinking", "thinking": "", "signature": ""}
            elif item.kind == TEXT:
                start = {"type": "text", "text": ""}
            else:
                start = {"type": "tool_use", "id": item.id, "name": item.name, "input": {}}
            return sse("content_block_start", {**index, "content_block": start})
        if event.op == "delta":
            if item.kind == REASONING:
                delta: dict = {"type": "thinking_delta", "thinking": event.text}
            elif item.kind == TEXT:
                delta = {"type": "text_delta", "text": event.text}
            else:
                delta = {"type": "input_json_delta", "partial_json": event.text}
            return sse("content_block_delta", {**index, "delta": delta})
        data = b""
        if item.kind == REASONING:
            data = sse("content_block_delta", {**index, "delta": {"type": "signature_delta",
                                                                  "signature": thinking_signature(item.text)}})
        return data + sse("content_block_stop", index)

    def closing(self, tracker: Tracker) -> bytes:
        if self.failed:
            return b""
        try:
            stop_reason, stop_sequence = self._stop(tracker)
        except APIError as error:
            return anthropic_error_event(error)
        return (sse("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                      "usage": self._usage(tracker, tracker.completion_tokens)})
                + sse("message_stop", {}))

    def delta_error(self, message: str) -> bytes:
        self.failed = True
        return anthropic_error_event(APIError(500, message, "server_error"))

    def stream_error(self, error: APIError, tracker: Tracker) -> bytes:
        self.failed = True
        return anthropic_error_event(error)

    # ---- collected ----------------------------------------------------------------------------------------------

    def response(self, tracker: Tracker) -> dict:
        choice = tracker.choices.get(0) or Choice()
        piece = self.parsers.piece(0, "".join(choice.text), True, choice.prompt_opens_thinking)
        self.blocks.feed(piece)
        self.blocks.finish()
        stop_reason, stop_sequence = self._stop(tracker)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [self.block(item) for item in self.blocks.items], "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": self._usage(tracker, tracker.completion_tokens)}
