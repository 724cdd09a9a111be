"""The stage actor: a bounded inbox, a run loop, and the statistics every stage keeps.

Stages talk only through messages put into each other's inboxes. A full inbox makes the sender
await (backpressure), never drop. Every message is stamped on entry so queue wait is measured.
"""
from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pipeline.tracing import TRACE_OFF, TraceRecorder

M = TypeVar("M")

# Seconds; shared by queue-wait and service-time histograms.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    samples: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.total += value * times
        self.samples += times

    def snapshot(self) -> dict[str, object]:
        return {
            "count": self.samples,
            "sum": self.total,
            "mean": self.total / self.samples if self.samples else 0.0,
            "buckets": dict(zip([*map(str, self.buckets), "+Inf"], self.counts)),
        }


@dataclass(slots=True)
class StageMetrics:
    items_in: int = 0
    items_out: int = 0
    queue_wait: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    service_time: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    batch_size: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))


class Stage(Generic[M]):
    """Base actor. Subclasses implement `run()`; the engine runs it as one task."""

    name: str = "stage"
    trace: TraceRecorder = TRACE_OFF  # the engine's recorder (pipeline/tracing.py): its waits and service spans

    def __init__(self, inbox_size: int) -> None:
        self._inbox: asyncio.Queue[tuple[float, M]] = asyncio.Queue(maxsize=inbox_size)
        self.metrics = StageMetrics()

    # --- the inbox -----------------------------------------------------------------------------
    async def put(self, message: M) -> None:
        await self._inbox.put((time.monotonic(), message))
        self.metrics.items_in += 1

    def put_nowait(self, message: M) -> None:
        """For an inbox sized so it can never be full (raises asyncio.QueueFull if it is)."""
        self._inbox.put_nowait((time.monotonic(), message))
        self.metrics.items_in += 1

    async def receive(self) -> M:
        entered, message = await self._inbox.get()
        received = time.monotonic()
        self.metrics.queue_wait.observe(received - entered)
        if self.trace.recording:
            self.trace.waited(self.name, message, entered, received)
        return message

    def receive_ready(self) -> list[M]:
        """Everything already waiting, without awaiting."""
        now = time.monotonic()
        messages: list[M] = []
        while not self._inbox.empty():
            entered, message = self._inbox.get_nowait()
            self.metrics.queue_wait.observe(now - entered)
            if self.trace.recording:
                self.trace.waited(self.name, message, entered, now)
            messages.append(message)
        return messages

    @property
    def inbox_depth(self) -> int:
        return self._inbox.qsize()

    # --- bookkeeping ---------------------------------------------------------------------------
    def record(self, started: float, batch: int, produced: int) -> None:
        ended = time.monotonic()
        self.metrics.service_time.observe(ended - started)
        if self.trace.recording:
            self.trace.served(self.name, started, ended, batch, produced)
        self.metrics.batch_size.observe(batch)
        self.metrics.items_out += produced

    def snapshot(self) -> dict[str, object]:
        m = self.metrics
        return {
            "items_in": m.items_in,
            "items_out": m.items_out,
            "inbox_depth": self.inbox_depth,
            "queue_wait_s": m.queue_wait.snapshot(),
            "service_time_s": m.service_time.snapshot(),
            "batch_size": m.batch_size.snapshot(),
        }

    async def run(self) -> None:
        raise NotImplementedError
