"""Request traces: a bounded ring of timed events that the stages, the step planner and the device thread append to
while recording, laid out as a Chrome trace-event file (pipeline/trace_export.py) for GET /debug/trace or for the
rotating files of --trace-dir (pipeline/trace_files.py).

The hooks reuse the clocks the stages already read for /debug/stages (a message's inbox stamp, a stage's service
start, the device thread's busy stamp) and sit behind one attribute check: while ``recording`` is False a hook costs
that check and nothing else (no call, no allocation). While recording, an event is one tuple appended to a deque,
which is safe from the event loop and the device thread alike; nothing is laid out until a trace is asked for.

Every event is a tuple whose first two fields are its kind and the monotonic time it was recorded (the end of what
it times), so a window of the ring is a filter on the second field.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Chunks
from typing import Any

# Event kinds (an event's first field) and the fields that follow its recording time:
WAIT = 0  # (WAIT, received, entered, stage, key): a message's wait in a stage's inbox; key: its request, or None
SERVICE = 1  # (SERVICE, ended, started, stage, batch, produced): one service span of a stage (`Stage.record`)
# (STEP_PLAN, planned, number, lane, decode_rows, verify_rows, prompt_chunks, prompt_tokens, tokens): a step's makeup
STEP_PLAN = 2
# (STEP_RUN, host_end, host_start, number, device_start, device_end): the device thread's launch of step `number`;
# the device marks are the clock's (CUDA events with their anchor), None where the launch computes the step itself
STEP_RUN = 3
DEVICE_JOB = 4  # (DEVICE_JOB, ended, started, name): another job of the device thread (loading, a drafter's forwards)
PREEMPT = 5  # (PREEMPT, at, key): decode gave a sequence back to prefill
REQUEST_END = 6  # (REQUEST_END, ended, key, admitted_at, prompt_tokens, cached_prompt_tokens, completed)

DEFAULT_TRACE_EVENTS = 1 << 17  # events the ring keeps (one small tuple each)
MAX_SESSION_S = 60.0  # the longest window GET /debug/trace records


def message_key(message: object) -> str | None:
    """The request an inbox message belongs to (a sample after the first as ``id#index``); None for a message that
    carries several (a step's tokens, a batch of deltas, a draft request)."""
    request_id = getattr(message, "request_id", None)  # an IntakeItem or a Request
    if request_id is not None:
        return request_id
    request = getattr(message, "request", None)  # a Sequence
    if request is None:
        return None
    index = message.index  # type: ignore[attr-defined]
    return request.request_id if not index else f"{request.request_id}#{index}"


class CudaClock:
    """Where each step ran on the GPU: a timing event recorded on the device's stream before the step's launch and
    one after it, placed on the host's monotonic clock through an anchor (an event recorded and waited for, so its
    host time is known). The device thread anchors again after ``reanchor`` (a new recording), which waits once for
    the work queued before it."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.anchor: tuple[Any, float] | None = None

    def reanchor(self) -> None:
        self.anchor = None

    def mark(self) -> tuple[Any, tuple[Any, float]]:
        """Device thread: an event queued on the device's stream now, with the anchor it is placed by."""
        import torch

        stream = torch.cuda.current_stream(self.device)
        anchor = self.anchor
        if anchor is None:
            first = torch.cuda.Event(enable_timing=True)
            first.record(stream)
            first.synchronize()
            anchor = self.anchor = (first, time.monotonic())
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event, anchor

    @staticmethod
    def resolve(mark: tuple[Any, tuple[Any, float]]) -> float | None:
        """The monotonic time the device reached a mark; None while it has not."""
        event, (anchor_event, anchor_host) = mark
        if not event.query():
            return None
        return anchor_host + anchor_event.elapsed_time(event) / 1e3


class TraceRecorder:
    """The ring and its switch. ``recording`` is on while a GET /debug/trace session runs or --trace-dir is set."""

    def __init__(self, capacity: int = DEFAULT_TRACE_EVENTS, clock: CudaClock | None = None) -> None:
        self.recording = False
        self.capacity = capacity
        self.events: deque[tuple] = deque(maxlen=capacity)
        self.clock = clock
        self.origin = time.monotonic()  # trace timestamps count from here (the same in every file)
        self.origin_unix = time.time()
        self._sessions = 0
        self._continuous = False

    # --- the switch ------------------------------------------------------------------------------------------------
    def begin_session(self) -> float:
        """Record until the matching ``end_session``; returns the session's start."""
        self._sessions += 1
        self._switch()
        return time.monotonic()

    def end_session(self) -> None:
        self._sessions -= 1
        self._switch()

    def set_continuous(self, on: bool) -> None:
        self._continuous = on
        self._switch()

    def _switch(self) -> None:
        recording = self._continuous or self._sessions > 0
        if recording and not self.recording and self.clock is not None:
            self.clock.reanchor()
        self.recording = recording

    def window(self, since: float, until: float) -> list[tuple]:
        """The events recorded after ``since`` and up to ``until``."""
        return [event for event in self.events.copy() if since < event[1] <= until]

    def recorded_since(self, since: float, count: int) -> bool:
        """At least ``count`` events were recorded after ``since`` (the ring's newest are its last)."""
        events = self.events
        return 0 < count <= len(events) and events[-count][1] > since

    def dropped_since(self, since: float) -> bool:
        """Events recorded after ``since`` have left the ring already (it filled up)."""
        events = self.events
        return len(events) == self.capacity and events[0][1] > since

    # --- hooks (called only while recording) ----------------------------------------------------------------------
    def waited(self, stage: str, message: object, entered: float, received: float) -> None:
        self.events.append((WAIT, received, entered, stage, message_key(message)))

    def served(self, stage: str, started: float, ended: float, batch: int, produced: int) -> None:
        self.events.append((SERVICE, ended, started, stage, batch, produced))

    def step_planned(self, number: int, lane: str, decode_chunks: Chunks[Any], prompt_chunks: Chunks[Any],
                     tokens: int) -> None:
        """The planner launched step ``number``: decode's chunks (a verify row asks for logits at several tokens)
        and the prompt chunks."""
        verify_rows = sum(1 for chunk in decode_chunks if chunk.logits_offsets is not None)
        prompt_tokens = sum(len(chunk.token_ids) for chunk in prompt_chunks)
        self.events.append((STEP_PLAN, time.monotonic(), number, lane, len(decode_chunks), verify_rows,
                            len(prompt_chunks), prompt_tokens, tokens))

    def device_mark(self) -> Any:
        """Device thread, before a job: the clock's mark (None without a device clock)."""
        return self.clock.mark() if self.clock is not None else None

    def device_work(self, job: object, started: float, device_started: Any) -> None:
        """Device thread, after a job that began at ``started``: a launched step (it has a number) or another job."""
        ended = time.monotonic()
        number = getattr(job, "number", None)
        if number is None:
            function = getattr(job, "function", None)
            name = getattr(function, "__qualname__", None) or getattr(getattr(function, "func", None),
                                                                     "__qualname__", "job")
            self.events.append((DEVICE_JOB, ended, started, name))
            return
        device_ended = self.clock.mark() if device_started is not None and self.clock is not None else None
        self.events.append((STEP_RUN, ended, started, number, device_started, device_ended))

    def preempted(self, sequence: object) -> None:
        self.events.append((PREEMPT, time.monotonic(), message_key(sequence)))

    def request_ended(self, request_id: str, request: Any, completed: bool) -> None:
        """The engine's last word on a request (``request``: the admitted Request, None when it never was)."""
        if request is None:
            self.events.append((REQUEST_END, time.monotonic(), request_id, None, 0, 0, completed))
            return
        self.events.append((REQUEST_END, time.monotonic(), request_id, request.arrival_time,
                            len(request.prompt_token_ids), request.cached_prompt_tokens, completed))

    def resolve(self, mark: Any) -> float | None:
        """A device mark's monotonic time (None: not reached yet, or no device clock)."""
        return CudaClock.resolve(mark) if mark is not None else None


TRACE_OFF = TraceRecorder(capacity=1)  # what a stage, planner or executor that no engine wired holds: never records
