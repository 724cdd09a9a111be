"""Pure-Python twin of ext/text_delta_sink.pyx: a streamed response's listener, with the common delta's
path as one call.

At batch 256 the listener runs 256 times per decode step on the event loop. Its common delta (not
final, no logprobs, text only) goes through Tracker.observe, the endpoint's event, its text template
and SSEBody.send (web/generation.py): eight Python calls. The sink does what they do for that delta
in one: it books the timing and counts on the tracker and its choice, and writes the text's SSE event
as one HTTP chunk. Every other delta, and a choice it has no template or Choice for yet, goes to
`slow`, the general path, whose results the sink must equal byte for byte and field for field
(tests/ext/test_text_delta_sink.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ext.sse_text_py import text_event_chunk


class TextDeltaSink:
    __slots__ = ("slow", "tracker", "templates", "write", "gaps", "clock", "count_offset")

    def __init__(self, slow: Callable[[Any], None], tracker: Any, templates: dict[int, tuple[bytes, bytes]],
                 write: Callable[[bytes], None], gaps: Any, clock: Callable[[], float], count_offset: bool) -> None:
        """slow(delta): the general path. tracker: the response's Tracker (its `choices` by index).
        templates: per choice index, the bytes around the text in its text-only event. write(chunk):
        the body's raw write. gaps: the inter-token latency histogram (a pipeline.stage.Histogram; a
        delta of k tokens after a gap of s seconds is k gaps of s/k, as ServerMetrics.inter_token_latency
        books them; the compiled sink observes inline, without the two calls). clock: the
        tracker's clock. count_offset: the endpoint counts characters sent (completions logprobs)."""
        self.slow = slow
        self.tracker = tracker
        self.templates = templates
        self.write = write
        self.gaps = gaps
        self.clock = clock
        self.count_offset = count_offset

    def __call__(self, delta: Any) -> None:
        if delta.finish_reason is not None or delta.logprobs:
            return self.slow(delta)
        index = delta.index
        tracker = self.tracker
        template = self.templates.get(index)
        choice = tracker.choices.get(index)
        if template is None or choice is None:
            return self.slow(delta)
        tokens = len(delta.token_ids)
        if tokens:
            now = self.clock()
            if tracker.first_token is None:
                tracker.first_token = now
            elif tracker.last_delta is not None:
                self.gaps.observe((now - tracker.last_delta) / tokens, tokens)
            tracker.last_delta = now
        tracker.prompt_tokens = delta.prompt_token_count
        choice.prompt_opens_thinking = delta.prompt_opens_thinking
        if delta.output_token_count > choice.output_tokens:
            choice.output_tokens = delta.output_token_count
        text = delta.text
        if self.count_offset:
            choice.text_offset += len(text)
        if text:
            self.write(text_event_chunk(template[0], text, template[1]))
        return None
