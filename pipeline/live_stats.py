"""A bounded history of what the engine does, for the live dashboard and `conveyor top`.

Two rings. The step ring holds one record per device step: its composition (decode rows, verify rows, prompt
tokens) and how long it held the device thread; the step planner reports each launch (one call), and the record is
appended when the device thread has run it, which costs one append per step. The sample ring holds one reading of
the engine's counters and gauges a second (pipeline/live_reading.py), with the steps of that second folded in as
running totals, so rates and means between any two samples are exact differences (pipeline/live_view.py).

A reading's counters are cumulative (the difference of two readings is what happened between them) and its gauges
the value at the reading; its latency buckets are the stages' own per-bucket counts (pipeline/stage.py,
LATENCY_BUCKETS then +Inf), copied.

Step time is measured from the host: a step's share of the device thread runs from its launch, or the previous
step's landing if that came later, to its own landing. Back to back (decode one step ahead) consecutive landings
are one device step apart on a GPU as on the CPU; a step launched onto an idle GPU counts its launch only. The
device's busy time is counted where it ran: a step that spans two samples adds its part before the first to the
first (it is in flight then) and the rest to the second, so a second's busy share is exact however long steps are.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.runner.executor import LaunchedStep
    from pipeline.runner.step_plan import ScheduledChunk

log = logging.getLogger("conveyor.live_stats")

SAMPLE_INTERVAL_S = 1.0
HISTORY_SAMPLES = 600  # ten minutes of samples a second
STEP_RING = 8192  # steps kept one by one (far more than a second holds, so a sample never misses one)


@dataclass(slots=True)
class StageReading:
    items_in: int
    items_out: int
    inbox: int  # messages waiting in its inbox
    queue_wait: tuple[int, ...]  # per-bucket counts of the inbox wait, seconds (pipeline/stage.py LATENCY_BUCKETS)
    service: tuple[int, ...]  # per-bucket counts of its service time per step


@dataclass(slots=True)
class EngineReading:
    stages: dict[str, StageReading]  # in pipeline order
    # gauges
    running: int  # sequences in the decode batch
    prefilling: int  # sequences waiting for or in prefill
    waiting_requests: int  # admitted requests not started
    waiting_tokens: int
    seats_held: int
    kv_blocks_used: int
    state_slots_used: int
    snapshots_held: int
    # counters
    picked_tokens: int  # tokens the steps picked: decode rows read, drafts accepted, prompts' first tokens
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    preemptions: int


@dataclass(slots=True)
class StepRecord:
    """One device step as the host saw it."""

    landed: float  # the clock (time.monotonic()) when the device thread had run its launch
    ms: float  # its share of the device thread (module docstring)
    decode_rows: int  # decode's rows, verify rows included
    verify_rows: int  # decode rows that pick more than one token (they verify drafts)
    draft_tokens: int  # positions those rows verify past their first pick
    prompt_tokens: int  # prompt tokens of the prefill chunks in the step


@dataclass(slots=True)
class _Launch:
    """A step's composition between its launch and its landing."""

    launched: float
    decode_rows: int
    verify_rows: int
    draft_tokens: int
    prompt_tokens: int


@dataclass(slots=True)
class StepTotals:
    """Running totals over every step folded into a sample (differences give any interval's figures)."""

    steps: int = 0
    decode_rows: int = 0
    verify_rows: int = 0
    draft_tokens: int = 0
    prompt_tokens: int = 0
    step_ms: float = 0.0  # the steps' own times, whole (a step's mean time is a difference of this over steps)
    busy_ms: float = 0.0  # device-thread time up to the sample: a step counts where it ran, across samples

    def add(self, record: StepRecord) -> None:
        self.steps += 1
        self.decode_rows += record.decode_rows
        self.verify_rows += record.verify_rows
        self.draft_tokens += record.draft_tokens
        self.prompt_tokens += record.prompt_tokens
        self.step_ms += record.ms

    def copy(self) -> StepTotals:
        return StepTotals(self.steps, self.decode_rows, self.verify_rows, self.draft_tokens, self.prompt_tokens,
                          self.step_ms, self.busy_ms)


@dataclass(slots=True)
class LiveSample:
    """The engine once a second: a reading, and the step totals up to then."""

    seq: int  # numbers samples from 1; a client asks for those after the last it has
    mono: float  # the clock (time.monotonic())
    wall: float  # time.time(), for plots
    reading: EngineReading
    steps: StepTotals
    longest_step_ms: float  # the longest step that landed since the previous sample (0: none)


class LiveStats:
    """The step ring and the sample ring. Event-loop thread only: records are appended by a future's callback."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S, history: int = HISTORY_SAMPLES,
                 step_ring: int = STEP_RING, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.steps: deque[StepRecord] = deque(maxlen=step_ring)
        self.samples: deque[LiveSample] = deque(maxlen=history)
        self.clock = clock
        self.started = time.time()  # tells a client's history of another engine from this one's
        self.wall_offset = self.started - clock()  # clock -> wall clock, for plots
        self._last_landed = 0.0
        # steps launched and not landed, and when the oldest of them took the device thread (launches run in order)
        self._in_flight = 0
        self._busy_since = 0.0
        self._counted_until = 0.0  # device-thread time is counted in busy_ms up to here (the previous sample)
        self._folded: StepRecord | None = None  # the newest record a sample has counted
        self._totals = StepTotals()
        self._seq = 0

    # --- the step path ---------------------------------------------------------------------------
    def step_launched(self, step: LaunchedStep, decode_chunks: Sequence[ScheduledChunk],
                      prompt_chunks: Sequence[ScheduledChunk], decode_picks: int) -> None:
        """The planner launched ``step``: decode's chunks (``decode_picks`` tokens picked by them in all) then the
        prompt chunks. Its record is appended once the device thread has run it."""
        decode_rows = len(decode_chunks)
        verify_rows = sum(1 for chunk in decode_chunks if len(chunk.rows) > 1) if decode_picks > decode_rows else 0
        prompt_tokens = sum(len(chunk.token_ids) for chunk in prompt_chunks) if prompt_chunks else 0
        launch = _Launch(self.clock(), decode_rows, verify_rows, decode_picks - decode_rows, prompt_tokens)
        if not self._in_flight:
            self._busy_since = launch.launched
        self._in_flight += 1
        step.launched.add_done_callback(partial(self._landed, launch))

    def _landed(self, launch: _Launch, future: asyncio.Future[Any]) -> None:
        now = self.clock()
        self._in_flight -= 1
        self._busy_since = now  # the next step queued, if any, has the device thread from now
        if future.cancelled() or future.exception() is not None:
            return  # a failed launch is the engine's error, not a step
        started = max(launch.launched, self._last_landed)
        self._last_landed = now
        self.steps.append(StepRecord(now, (now - started) * 1000.0, launch.decode_rows, launch.verify_rows,
                                     launch.draft_tokens, launch.prompt_tokens))

    # --- the sample ring -------------------------------------------------------------------------
    def take_sample(self, reading: EngineReading) -> LiveSample:
        """Fold the steps landed since the previous sample into the totals and keep a sample."""
        mono = self.clock()
        longest = 0.0
        totals, counted = self._totals, self._counted_until
        for record in self._unfolded():
            totals.add(record)
            longest = max(longest, record.ms)
            totals.busy_ms += max(0.0, record.landed - max(record.landed - record.ms / 1000.0, counted)) * 1000.0
        if self._in_flight > 0:  # the step on the device thread now: its part up to this sample
            totals.busy_ms += max(0.0, mono - max(self._busy_since, counted)) * 1000.0
        self._counted_until = mono
        if self.steps:
            self._folded = self.steps[-1]
        self._seq += 1
        sample = LiveSample(self._seq, mono, mono + self.wall_offset, reading, totals.copy(), longest)
        self.samples.append(sample)
        return sample

    def _unfolded(self) -> Iterator[StepRecord]:
        """The records after the newest one already folded (all of them if it has left the ring)."""
        fresh: list[StepRecord] = []
        for record in reversed(self.steps):
            if record is self._folded:
                break
            fresh.append(record)
        return reversed(fresh)

    async def run(self, read: Callable[[], EngineReading]) -> None:
        """Sample every interval until cancelled. A reading that fails is logged once and skipped: the dashboard
        must never stop the engine."""
        failed = False
        next_at = self.clock()
        while True:
            try:
                self.take_sample(read())
            except Exception:  # noqa: BLE001 - the engine goes on without its history
                if not failed:
                    log.exception("the live statistics could not read the engine")
                failed = True
            now = self.clock()
            next_at = next_at + self.interval_s if next_at + self.interval_s > now else now + self.interval_s
            await asyncio.sleep(next_at - now)
