"""Wall time spent in chosen host functions while a block runs: each wrapped in place (sync or async, on any
thread), totals and calls kept per name. Overlapping calls on different threads each count. Used by
``bench/spec.py --host-times`` to see where a speculative cycle's host time goes without a profiler's own cost.
"""
from __future__ import annotations

import functools
import inspect
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def host_times(targets: list[tuple[Any, str]],
               timeline: list[tuple[str, str, float, float]] | None = None) -> Iterator[dict[str, dict[str, float]]]:
    """Time every call of ``getattr(owner, name)`` for each (owner, name) while the block runs; yields a dict filled
    when it ends: name -> {calls, total_ms, mean_us}. ``timeline``: a list every call is appended to, as (name,
    thread, start, end) in ``time.perf_counter`` seconds, to see what ran when on which thread."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    lock = threading.Lock()
    saved = []
    for owner, name in targets:
        raw = inspect.getattr_static(owner, name)
        label = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
        function = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        wrapped = _timed(function, label, totals, lock, timeline)
        if isinstance(raw, classmethod):
            wrapped = classmethod(wrapped)
        elif isinstance(raw, staticmethod):
            wrapped = staticmethod(wrapped)
        saved.append((owner, name, raw))
        setattr(owner, name, wrapped)
    report: dict[str, dict[str, float]] = {}
    try:
        yield report
    finally:
        for owner, name, raw in saved:
            setattr(owner, name, raw)
        for label, (calls, total) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
            report[label] = dict(calls=calls, total_ms=round(total * 1e3, 3),
                                 mean_us=round(total / calls * 1e6, 1) if calls else 0.0)


def _timed(function, label: str, totals: dict, lock: threading.Lock, timeline: list | None):
    def add(started: float) -> None:
        ended = time.perf_counter()
        with lock:
            entry = totals[label]
            entry[0] += 1
            entry[1] += ended - started
            if timeline is not None:
                timeline.append((label, threading.current_thread().name, started, ended))

    if inspect.iscoroutinefunction(function):
        @functools.wraps(function)
        async def timed_async(*args, **kwargs):
            started = time.perf_counter()
            try:
                return await function(*args, **kwargs)
            finally:
                add(started)
        return timed_async

    @functools.wraps(function)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            add(started)
    return timed


def cycle_timeline(timeline: list[tuple[str, str, float, float]], last: int = 120) -> list[str]:
    """The last ``last`` calls in start order, one line each: start and end in us after the first of them, the
    thread, the name (nested calls appear inside their callers' spans)."""
    calls = sorted(timeline, key=lambda call: call[2])[-last:]
    if not calls:
        return []
    origin = calls[0][2]
    return [f"{(start - origin) * 1e6:9.0f} {(end - origin) * 1e6:9.0f} {thread[:18]:18s} {name}"
            for name, thread, start, end in calls]
