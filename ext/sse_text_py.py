"""Pure-Python twin of ext/sse_text.pyx: per-token SSE text events and HTTP chunk framing.

The streaming path formats one event per token (batch-size times per decode step, on the event
loop); the compiled module does each in one scan and one allocation. Results are byte-identical.
"""
from __future__ import annotations

import orjson


def _check(before: bytes, text: str, after: bytes) -> None:
    """The compiled module's typed arguments refuse other types (None, bytearray) with TypeError."""
    if type(before) is not bytes or type(after) is not bytes or type(text) is not str:
        raise TypeError("text_event takes (bytes, str, bytes)")


def text_event(before: bytes, text: str, after: bytes) -> bytes:
    """before + the JSON string of text + after (a lone surrogate raises orjson's TypeError)."""
    _check(before, text, after)
    return b"%b%b%b" % (before, orjson.dumps(text), after)


def http_chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk; an empty one would end the chunked body, so it is refused."""
    if type(data) is not bytes:
        raise TypeError("http_chunk takes bytes")
    if not data:
        raise ValueError("an empty chunk ends the body")
    return b"%x\r\n%b\r\n" % (len(data), data)


def text_event_chunk(before: bytes, text: str, after: bytes) -> bytes:
    """http_chunk(text_event(before, text, after))."""
    return http_chunk(text_event(before, text, after))
