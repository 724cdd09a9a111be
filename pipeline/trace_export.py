"""A window of trace events (pipeline/tracing.py) laid out as a Chrome trace-event file, which Perfetto and
chrome://tracing open.

Three processes. "stages": a track a stage with its service spans, and a track a stage's inbox with the waits of
messages that carry no single request (a step's tokens, a batch of deltas). "device": the device thread's launches
and other jobs, and below them the device's steps with the gaps where it idled. "requests": a track a request while
it lives (reused after it ends), holding its whole span and inside it its phases: each stage's queue wait and its time
in that stage, in order (a request's phases are cut at the moments it entered and left each inbox).

Spans on one track must nest or follow one another: spans of one stage that overlap (decode's steps overlap when it
runs one ahead, a grammar wait overlaps intake's next requests) are spread over extra tracks of that stage.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from pipeline.tracing import DEVICE_JOB, PREEMPT, REQUEST_END, SERVICE, STEP_PLAN, STEP_RUN, WAIT

STAGES_PID, DEVICE_PID, REQUESTS_PID = 1, 2, 3
HOST_TID, DEVICE_TID = 1, 2
STAGE_TIDS = 1000  # a stage's service tracks are tid (i + 1) * 1000 + lane, its inbox tracks the same + 500
INBOX_TIDS = 500
IDLE_MIN_S = 10e-6  # shorter gaps between device steps are not drawn (they are counted in device_idle_ms)
TRACE_FORMAT_VERSION = 1

Span = tuple[float, float, str, str, dict]  # (start, end, name, category, args)


def nesting_lanes(spans: list[Span]) -> list[int]:
    """A lane for each span such that the spans of one lane nest or follow one another (Chrome's rule for one
    track), in as few lanes as the greedy order by start needs."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1]))
    open_ends: list[list[float]] = []  # per lane: the ends of the spans open around the current start
    lanes = [0] * len(spans)
    for i in order:
        start, end = spans[i][0], spans[i][1]
        for lane, ends in enumerate(open_ends):
            while ends and ends[-1] <= start:
                ends.pop()
            if not ends or end <= ends[-1]:
                break
        else:
            lane = len(open_ends)
            open_ends.append([])
        open_ends[lane].append(end)
        lanes[i] = lane
    return lanes


class ChromeTrace:
    """Builds the traceEvents list: X spans and M (metadata) events, timestamps in microseconds since ``origin``."""

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.events: list[dict] = []
        self._named: set[tuple[int, int]] = set()

    def us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def span(self, pid: int, tid: int, span: Span) -> None:
        start, end, name, category, args = span
        ts = self.us(start)
        duration = max(0.0, round(self.us(end) - ts, 3))
        self.events.append({"name": name, "cat": category, "ph": "X", "ts": ts, "dur": duration, "pid": pid, "tid": tid,
                            "args": args})

    def process(self, pid: int, name: str) -> None:
        self.events.append({"name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": 0, "args": {"name": name}})
        self.events.append({"name": "process_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
                            "args": {"sort_index": pid}})

    def thread(self, pid: int, tid: int, name: str) -> None:
        if (pid, tid) in self._named:
            return
        self._named.add((pid, tid))
        self.events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}})
        self.events.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": tid,
                            "args": {"sort_index": tid}})

    def track(self, pid: int, first_tid: int, name: str, spans: list[Span]) -> None:
        """Spans of one kind on as many tracks as their overlaps need (``name``, ``name (2)``, ...)."""
        for lane, span in zip(nesting_lanes(spans), spans):
            self.thread(pid, first_tid + lane, name if not lane else f"{name} ({lane + 1})")
            self.span(pid, first_tid + lane, span)


def chrome_trace(events: Iterable[tuple], *, origin: float, origin_unix: float, since: float, until: float,
                 stages: tuple[str, ...], resolve: Callable[[Any], float | None],
                 events_dropped: bool = False) -> dict:
    """The trace-event JSON object of ``events`` (recorded in (since, until]); ``resolve`` places a device mark on
    the monotonic clock (None: not reached); ``events_dropped``: the ring lost some of the window's events."""
    by_kind: dict[int, list[tuple]] = defaultdict(list)
    for event in events:
        by_kind[event[0]].append(event)
    trace = ChromeTrace(origin)
    trace.process(STAGES_PID, "stages")
    _stage_tracks(trace, by_kind, stages)
    trace.process(DEVICE_PID, "device")
    device = _device_tracks(trace, by_kind, resolve)
    trace.process(REQUESTS_PID, "requests")
    requests = _request_tracks(trace, by_kind, until)
    return {"traceEvents": trace.events, "displayTimeUnit": "ms",
            "otherData": {"format": f"conveyor trace {TRACE_FORMAT_VERSION}", "clock": "monotonic",
                          "origin_unix_s": origin_unix, "window_start_us": trace.us(since),
                          "window_end_us": trace.us(until), "events_dropped": events_dropped,
                          "requests": requests, **device}}


def _stage_tracks(trace: ChromeTrace, by_kind: dict[int, list[tuple]], stages: tuple[str, ...]) -> None:
    served: dict[str, list[Span]] = defaultdict(list)
    for _, ended, started, stage, batch, produced in by_kind[SERVICE]:
        served[stage].append((started, ended, stage, "stage", {"batch": batch, "produced": produced}))
    waited: dict[str, list[Span]] = defaultdict(list)
    for _, received, entered, stage, key in by_kind[WAIT]:
        if key is None:
            waited[stage].append((entered, received, f"{stage} queue", "queue", {}))
    names = list(stages) + sorted((set(served) | set(waited)) - set(stages))
    for i, stage in enumerate(names):
        base = (i + 1) * STAGE_TIDS
        trace.thread(STAGES_PID, base, stage)  # every stage gets its track, busy or not
        trace.track(STAGES_PID, base, stage, served.get(stage, []))
        if stage in waited:
            trace.track(STAGES_PID, base + INBOX_TIDS, f"{stage} inbox", waited[stage])


def _device_tracks(trace: ChromeTrace, by_kind: dict[int, list[tuple]],
                   resolve: Callable[[Any], float | None]) -> dict[str, Any]:
    """The device thread's launches and jobs, the device's steps and idle gaps; returns the window's totals."""
    plans = {event[2]: event for event in by_kind[STEP_PLAN]}
    host: list[Span] = []
    device: list[Span] = []
    for _, host_end, host_start, number, device_start, device_end in by_kind[STEP_RUN]:
        args: dict[str, Any] = {"step": number, "host_ms": round((host_end - host_start) * 1e3, 3)}
        plan = plans.get(number)
        if plan is not None:
            _, _, _, lane, decode_rows, verify_rows, prompt_chunks, prompt_tokens, tokens = plan
            args.update(lane=lane, decode_rows=decode_rows, verify_rows=verify_rows, prompt_chunks=prompt_chunks,
                        prompt_tokens=prompt_tokens, tokens=tokens)
        if device_start is None:  # the launch computed the step itself (the CPU): its device span is the launch's
            span = (host_start, host_end)
        else:
            span = (resolve(device_start), resolve(device_end))
        if span[0] is not None and span[1] is not None:
            args["device_ms"] = round((span[1] - span[0]) * 1e3, 3)
            device.append((span[0], span[1], "step", "device", args))
        host.append((host_start, host_end, "step launch", "device", args))
    for _, ended, started, name in by_kind[DEVICE_JOB]:
        host.append((started, ended, "device job", "device", {"function": name}))
    trace.thread(DEVICE_PID, HOST_TID, "device thread")
    trace.track(DEVICE_PID, HOST_TID, "device thread", host)
    device.sort(key=lambda s: s[0])
    laid: list[Span] = []
    busy = idle = 0.0
    for start, end, name, category, args in device:
        if laid:
            previous_end = laid[-1][1]
            start = max(start, previous_end)  # one stream runs one step at a time: an anchor's error never overlaps
            end = max(end, start)
            gap = start - previous_end
            idle += gap
            if gap >= IDLE_MIN_S:
                laid.append((previous_end, start, "device idle", "idle", {"idle_ms": round(gap * 1e3, 3)}))
        busy += end - start
        laid.append((start, end, name, category, args))
    trace.thread(DEVICE_PID, DEVICE_TID, "device")
    trace.track(DEVICE_PID, DEVICE_TID, "device", laid)
    return {"steps": len(by_kind[STEP_RUN]), "device_busy_ms": round(busy * 1e3, 3),
            "device_idle_ms": round(idle * 1e3, 3)}


def _request_tracks(trace: ChromeTrace, by_kind: dict[int, list[tuple]], until: float) -> int:
    """Each request (each sample after the first apart) on a track of its own while it lives; returns how many."""
    marks: dict[str, list[tuple[float, str, dict]]] = defaultdict(list)
    for _, received, entered, stage, key in by_kind[WAIT]:
        if key is not None:
            marks[key].append((entered, f"{stage} queue", {}))
            marks[key].append((received, stage, {}))
    for _, at, key in by_kind[PREEMPT]:
        if key is not None:
            marks[key].append((at, "prefill", {"preempted": True}))
    ends = {event[2]: event for event in by_kind[REQUEST_END]}
    groups: list[tuple[float, float, str, list[Span]]] = []
    for key in set(marks) | set(ends):
        request_id, _, sample = key.partition("#")
        end_event = ends.get(request_id)
        end = end_event[1] if end_event is not None else until
        points = sorted(m for m in marks.get(key, []) if m[0] <= end)
        starts = [points[0][0]] if points else []
        if end_event is not None and end_event[3] is not None and not sample:
            starts.append(end_event[3])  # admitted before the window's first mark of it
        if not starts:
            continue
        start = min(starts)
        args: dict[str, Any] = {"request_id": request_id}
        if sample:
            args["sample"] = int(sample)
        if end_event is not None:
            _, _, _, _, prompt_tokens, cached, completed = end_event
            args.update(prompt_tokens=prompt_tokens, cached_prompt_tokens=cached, completed=completed)
        else:
            args["open"] = True  # still running when the window closed
        spans: list[Span] = [(start, end, "request", "request", args)]
        for (at, name, phase_args), following in zip(points, points[1:] + [(end, "", {})]):
            spans.append((at, following[0], name, "request", phase_args))
        groups.append((start, end, key, spans))
    groups.sort(key=lambda g: (g[0], g[2]))
    free: list[tuple[float, int]] = []  # (end of its last request, lane)
    lanes = 0
    for start, end, _, spans in groups:
        if free and free[0][0] <= start:
            _, lane = heapq.heappop(free)
        else:
            lane, lanes = lanes, lanes + 1
        trace.thread(REQUESTS_PID, lane + 1, f"lane {lane + 1}")
        for span in spans:
            trace.span(REQUESTS_PID, lane + 1, span)
        heapq.heappush(free, (end, lane))
    return len(groups)
