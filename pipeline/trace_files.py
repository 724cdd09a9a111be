"""--trace-dir: the recorder runs all the time, and the ring goes to disk in rotating Chrome trace files.

Every ``file_s`` seconds, or sooner when the ring is half full (so nothing is dropped between two files), the events
recorded since the previous file are laid out and written, off the event loop, to a new file of the directory
(``conveyor-trace-<date>-<time>-<n>.json``, written under a temporary name and renamed, so a reader never sees half a
file). Only the newest ``max_files`` files of that name are kept, so the directory holds at most ``max_files`` files
of at most one ring of events each.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from pipeline.trace_export import chrome_trace
from pipeline.tracing import TraceRecorder

log = logging.getLogger("conveyor.trace_files")

FILE_PREFIX = "conveyor-trace-"
FILE_SUFFIX = ".json"
CHECK_S = 1.0  # how often the ring's fill is looked at between files


def prepare_trace_dir(directory: str) -> Path:
    """The directory, created if missing; a path that is not a writable directory is a ValueError naming it."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--trace-dir {directory}: cannot create it ({exc.strerror or exc})") from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--trace-dir {directory}: not a writable directory")
    return path


class TraceFiles:
    def __init__(self, recorder: TraceRecorder, directory: str, file_s: float, max_files: int,
                 stages: tuple[str, ...], clock: Callable[[], float] = time.monotonic) -> None:
        self.recorder = recorder
        self.directory = prepare_trace_dir(directory)
        self.file_s = file_s
        self.max_files = max_files
        self.stages = stages
        self.clock = clock
        self.written = 0  # files written by this server
        self._since = clock()

    async def run(self) -> None:
        """Write a file every ``file_s`` (or when the ring is half full) until cancelled."""
        while True:
            due = self._since + self.file_s
            while self.clock() < due and not self.recorder.recorded_since(self._since, self.recorder.capacity // 2):
                await asyncio.sleep(min(CHECK_S, max(0.0, due - self.clock())))
            await self.write()

    async def write(self) -> Path | None:
        """The events since the previous file into a new one (None when there were none)."""
        since, until = self._since, self.clock()
        self._since = until
        recorder = self.recorder
        if recorder.clock is not None:
            recorder.clock.reanchor()  # each file's device times from an anchor of its own
        events = recorder.window(since, until)
        if not events:
            return None
        self.written += 1
        name = f"{FILE_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{self.written:05d}{FILE_SUFFIX}"
        path = self.directory / name
        try:
            await asyncio.to_thread(self._write, path, events, since, until, recorder.dropped_since(since))
        except OSError:  # a full disk must not stop the engine: this file is lost, the next one is tried
            log.exception("writing the trace file %s", path)
            return None
        return path

    def _write(self, path: Path, events: list[tuple], since: float, until: float, dropped: bool) -> None:
        recorder = self.recorder
        trace = chrome_trace(events, origin=recorder.origin, origin_unix=recorder.origin_unix, since=since,
                             until=until, stages=self.stages, resolve=recorder.resolve, events_dropped=dropped)
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(orjson.dumps(trace))
        os.replace(partial, path)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest ``max_files`` trace files (names sort by time, then by number)."""
        files = sorted(p for p in self.directory.iterdir()
                       if p.name.startswith(FILE_PREFIX) and p.name.endswith(FILE_SUFFIX))
        for old in files[:-self.max_files]:
            try:
                old.unlink()
            except FileNotFoundError:
                pass
