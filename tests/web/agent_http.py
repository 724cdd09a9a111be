"""Plain HTTP for the agent API tests: the exact bodies and headers, and the raw status and JSON that come back."""
from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson


def post_json(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=orjson.dumps(body), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, orjson.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, orjson.loads(error.read())


@contextmanager
def post_stream(url: str, body: Any, headers: dict[str, str] | None = None) -> Iterator[Any]:
    """The open response of a streamed request; iterate it for its lines (bytes)."""
    request = urllib.request.Request(url, data=orjson.dumps(body), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=60) as reply:
        yield reply


def sse_events(url: str, body: Any, headers: dict[str, str] | None = None) -> list[tuple[str | None, Any]]:
    """A whole SSE stream as (event name, data) pairs."""
    events: list[tuple[str | None, Any]] = []
    name = None
    with post_stream(url, body, headers) as reply:
        for raw in reply:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = line[len("data: "):]
                events.append((name, data if data == "[DONE]" else orjson.loads(data)))
                name = None
    return events
