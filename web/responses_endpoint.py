"""The Responses API face of the generation core: output items and the typed event stream.

Events, in order, each with the next `sequence_number`: `response.created`, `response.in_progress`; per item
`output_item.added`, its parts (`content_part.added`, text / reasoning / argument deltas, their `.done`),
`output_item.done`; then exactly one of `response.completed` (with usage), `response.incomplete` (the output hit
max_output_tokens or the context's end) or `response.failed` (an error, a timeout, a shutdown). Codex reads a
stream without `response.completed` as an error and takes tool calls from `output_item.done`.
"""
from __future__ import annotations

import time
from typing import Any

from pipeline.request import FinishReason, OutputDelta
from web.generation import Choice, Endpoint, Tracker
from web.output_items import REASONING, TEXT, ItemEvent, OutputItem, OutputItems
from web.output_parsing import ChoiceParsers
from web.protocol_errors import APIError
from web.response_store import ResponseStore
from web.responses_body import (new_item_id, new_response_id, opened_item, output_item, reasoning_part,
                                response_object, responses_event, responses_usage, text_part)
from web.responses_request import ResponsesRequest


class ResponsesEndpoint(Endpoint):
    api = "responses"

    def __init__(self, state: Any, model: str, request: ResponsesRequest, parsers: ChoiceParsers,
                 store: ResponseStore) -> None:
        super().__init__(state, model, False, False)
        self.id = new_response_id()
        self.request = request
        self.parsers = parsers
        self.store = store
        self.created = int(time.time())
        self.items = OutputItems(new_item_id)
        self.sequence = 0
        self.encode = state.ready_engine().tokenizer.encode

    # ---- the response object ------------------------------------------------------------------------------------

    def _body(self, status: str, tracker: Tracker | None, **extra: Any) -> dict:
        output = [self._item(item, status) for item in self.items.items]
        usage = None
        if tracker is not None:
            reasoning = "".join(i.text for i in self.items.items if i.kind == REASONING)
            reasoning_tokens = len(self.encode(reasoning, add_special_tokens=False)) if reasoning else 0
            usage = responses_usage(tracker.prompt_tokens, tracker.cached_tokens, tracker.completion_tokens,
                                    min(reasoning_tokens, tracker.completion_tokens))
        return response_object(self.id, self.created, self.model, self.request.echo, status=status, output=output,
                               usage=usage, previous_response_id=self.request.previous_response_id, **extra)

    def _item(self, item: OutputItem, status: str = "completed") -> dict:
        last = item is self.items.items[-1] if self.items.items else False
        item_status = "incomplete" if status != "completed" and last else "completed"
        return output_item(item, status=item_status if item.done else "in_progress",
                           summary=self.request.summary, encrypted=self.request.encrypted_reasoning)

    def _final(self, tracker: Tracker) -> tuple[str, dict]:
        """(the terminal event's type, the response) for how the choice ended."""
        choice = tracker.choices.get(0) or Choice()
        reason = choice.finish_reason
        if reason is FinishReason.STOP:
            body = self._body("completed", tracker)
            self._store(body)
            return "response.completed", body
        if reason is FinishReason.LENGTH:
            body = self._body("incomplete", tracker, incomplete_reason="max_output_tokens")
            self._store(body)
            return "response.incomplete", body
        if reason is FinishReason.ERROR:
            error = {"code": "server_error", "message": choice.error or "the request failed"}
        elif self.state.engine is not None and self.state.engine.draining:
            error = {"code": "server_shutting_down", "message": "the server is shutting down"}
        else:
            error = {"code": "aborted", "message": "the request was cancelled"}
        return "response.failed", self._body("failed", tracker, error=error)

    def _store(self, body: dict) -> None:
        if self.request.store:
            self.store.put(self.id, body, [*self.request.items, *body["output"]])

    # ---- streaming ----------------------------------------------------------------------------------------------

    def _event(self, payload: dict) -> bytes:
        payload["sequence_number"] = self.sequence
        self.sequence += 1
        return responses_event(payload)

    def opening(self, first: OutputDelta, n: int) -> bytes:
        body = self._body("in_progress", None)
        return (self._event({"type": "response.created", "response": body})
                + self._event({"type": "response.in_progress", "response": body}))

    def event(self, delta: OutputDelta, choice: Choice) -> bytes:
        finished = delta.finish_reason is not None
        piece = self.parsers.piece(delta.index, delta.text, finished, delta.prompt_opens_thinking)
        events = self.items.feed(piece)
        if finished:
            events += self.items.finish()
        if not events:
            return b""
        status = "completed" if not finished or delta.finish_reason is FinishReason.STOP else "incomplete"
        return b"".join(self._render(event, status) for event in events)

    def closing(self, tracker: Tracker) -> bytes:
        kind, body = self._final(tracker)
        return self._event({"type": kind, "response": body})

    def delta_error(self, message: str) -> bytes:
        return b""  # closing sends response.failed with the message

    def stream_error(self, error: APIError, tracker: Tracker) -> bytes:
        closed = b"".join(self._render(event, "incomplete") for event in self.items.finish())
        failure = {"code": error.code or error.type, "message": error.message}
        return closed + self._event({"type": "response.failed", "response": self._body("failed", tracker,
                                                                                        error=failure)})

    def failure_stream(self, error: APIError) -> bytes:
        """The whole stream of a request refused before it ran (its prompt does not fit)."""
        failed = self._body("failed", None, error={"code": error.code or error.type, "message": error.message})
        return (self._event({"type": "response.created", "response": self._body("in_progress", None)})
                + self._event({"type": "response.failed", "response": failed}))

    def _render(self, event: ItemEvent, status: str) -> bytes:
        item = event.item
        where = {"item_id": item.id, "output_index": item.position}
        if event.op == "open":
            data = self._event({"type": "response.output_item.added", "output_index": item.position,
                                "item": opened_item(item)})
            if item.kind != "tool_call":
                part = text_part("") if item.kind == TEXT else reasoning_part("")
                data += self._event({"type": "response.content_part.added", **where, "content_index": 0,
                                     "part": part})
            return data
        if event.op == "delta":
            if item.kind == TEXT:
                return self._event({"type": "response.output_text.delta", **where, "content_index": 0,
                                    "delta": event.text, "logprobs": []})
            if item.kind == REASONING:
                return self._event({"type": "response.reasoning_text.delta", **where, "content_index": 0,
                                    "delta": event.text})
            return self._event({"type": "response.function_call_arguments.delta", **where, "delta": event.text})
        text = item.text
        if item.kind == TEXT:
            data = (self._event({"type": "response.output_text.done", **where, "content_index": 0, "text": text,
                                 "logprobs": []})
                    + self._event({"type": "response.content_part.done", **where, "content_index": 0,
                                   "part": text_part(text)}))
        elif item.kind == REASONING:
            data = (self._event({"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text})
                    + self._event({"type": "response.content_part.done", **where, "content_index": 0,
                                   "part": reasoning_part(text)}))
            if self.request.summary:
                data += self._summary_events(where, text)
        else:
            data = self._event({"type": "response.function_call_arguments.done", **where, "name": item.name,
                                "arguments": text})
        return data + self._event({"type": "response.output_item.done", "output_index": item.position,
                                   "item": self._item(item, status)})

    def _summary_events(self, where: dict, text: str) -> bytes:
        """The reasoning as its own summary (one part), for clients that show summaries only."""
        part = {"type": "summary_text", "text": text}
        return (self._event({"type": "response.reasoning_summary_part.added", **where, "summary_index": 0,
                             "part": {"type": "summary_text", "text": ""}})
                + self._event({"type": "response.reasoning_summary_text.delta", **where, "summary_index": 0,
                               "delta": text})
                + self._event({"type": "response.reasoning_summary_text.done", **where, "summary_index": 0,
                               "text": text})
                + self._event({"type": "response.reasoning_summary_part.done", **where, "summary_index": 0,
                               "part": part}))

    # ---- collected ----------------------------------------------------------------------------------------------

    def response(self, tracker: Tracker) -> dict:
        choice = tracker.choices.get(0) or Choice()
        piece = self.parsers.piece(0, "".join(choice.text), True, choice.prompt_opens_thinking)
        self.items.feed(piece)
        self.items.finish()
        return self._final(tracker)[1]
