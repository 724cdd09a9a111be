"""A bounded pool of daemon threads for grammar compilations.

xgrammar's native compile cannot be interrupted, so a thread inside one must never keep the process from exiting:
concurrent.futures' workers are joined at interpreter exit, these threads are daemons. The pool's size bounds how
many compilations run (and take CPU) at once, those whose requests stopped waiting included; jobs beyond it wait in
order, and a job cancelled before it starts never runs.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, eq=False)
class CompileJob:
    """One piece of work and its result; the times are written by the thread that runs it."""

    work: Callable[[], Any]
    future: Future = field(default_factory=Future)
    started_at: float | None = None  # time.monotonic() when a thread took it
    finished_at: float | None = None

    def running_for(self, now: float) -> float:
        """Seconds it has run (0 while queued)."""
        if self.started_at is None:
            return 0.0
        return (self.finished_at or now) - self.started_at


class CompilePool:
    def __init__(self, size: int, name: str = "grammar-compile") -> None:
        if size < 1:
            raise ValueError("a compile pool needs at least one thread")
        self.size = size
        self.name = name
        self._jobs: queue.SimpleQueue[CompileJob | None] = queue.SimpleQueue()
        self._running: list[CompileJob | None] = [None] * size  # slot i: the job thread i runs
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, work: Callable[[], Any]) -> CompileJob:
        job = CompileJob(work)
        with self._lock:
            if self._closed:
                raise RuntimeError("the compile pool is shut down")
            if not self._threads:  # started on first use: a server without structured output has none
                for slot in range(self.size):
                    thread = threading.Thread(target=self._work, args=(slot,), name=f"{self.name}-{slot}",
                                              daemon=True)
                    thread.start()
                    self._threads.append(thread)
            self._jobs.put(job)
        return job

    def running(self) -> list[CompileJob]:
        """The jobs threads are running now (read from any thread)."""
        return [job for job in list(self._running) if job is not None]

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def shutdown(self) -> None:
        """Cancel the jobs not started and let every thread end after its current job (never waits for one)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.future.cancel()
            for _ in self._threads:
                self._jobs.put(None)

    def _work(self, slot: int) -> None:
        while (job := self._jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            job.started_at = time.monotonic()
            self._running[slot] = job
            try:
                result = job.work()
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits for the job
                job.finished_at = time.monotonic()
                self._running[slot] = None
                job.future.set_exception(exc)
            else:
                job.finished_at = time.monotonic()
                self._running[slot] = None
                job.future.set_result(result)
