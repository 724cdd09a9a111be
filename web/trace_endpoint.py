"""GET /debug/trace?seconds=N: record the engine for N seconds and answer a Chrome trace-event file of that window
(Perfetto and chrome://tracing open it; pipeline/trace_export.py says what it holds).

The engine records while at least one such request waits (or always, with --trace-dir); several may overlap, each
gets its own window. The response's headers are sent when the recording starts, the file when it ends (laid out off
the event loop). A client that leaves early ends its recording.
"""
from __future__ import annotations

import asyncio
import math
import time

import orjson
from aiohttp import web

from pipeline.engine import Engine
from pipeline.trace_export import chrome_trace
from pipeline.tracing import MAX_SESSION_S
from web.app import STATE
from web.protocol import bad_request

MIN_SESSION_S = 0.1
DEFAULT_SESSION_S = 5.0


def session_seconds(text: str | None) -> float:
    """The ``seconds`` query parameter: a number in [MIN_SESSION_S, MAX_SESSION_S] (absent: DEFAULT_SESSION_S)."""
    if text is None:
        return DEFAULT_SESSION_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not MIN_SESSION_S <= seconds <= MAX_SESSION_S:  # (nan fails too)
        raise bad_request(f"seconds must be a number from {MIN_SESSION_S:g} to {MAX_SESSION_S:g}, got {text!r}",
                          "seconds")
    return seconds


async def debug_trace(request: web.Request) -> web.StreamResponse:
    """The headers go out as soon as the recording runs (a client knows its window has begun), the file at its end."""
    engine = request.app[STATE].ready_engine()
    seconds = session_seconds(request.query.get("seconds"))
    name = time.strftime("conveyor-trace-%Y%m%d-%H%M%S.json")
    response = web.StreamResponse(headers={"Content-Type": "application/json",
                                           "Content-Disposition": f'attachment; filename="{name}"'})
    recorder = engine.trace
    since = recorder.begin_session()
    try:
        await response.prepare(request)
        await asyncio.sleep(seconds)  # the recording itself: the window is this long
    finally:
        recorder.end_session()  # also when the client leaves early (its handler is cancelled)
    until = time.monotonic()
    await response.write(await asyncio.to_thread(trace_file, engine, since, until))
    await response.write_eof()
    return response


def trace_file(engine: Engine, since: float, until: float) -> bytes:
    """The trace-event JSON of what the engine recorded in (since, until] (run off the event loop)."""
    recorder = engine.trace
    return orjson.dumps(chrome_trace(recorder.window(since, until), origin=recorder.origin,
                                     origin_unix=recorder.origin_unix, since=since, until=until,
                                     stages=tuple(stage.name for stage in engine.stages), resolve=recorder.resolve,
                                     events_dropped=recorder.dropped_since(since)))


def add_trace_routes(app: web.Application) -> None:
    app.router.add_get("/debug/trace", debug_trace)
