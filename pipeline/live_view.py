"""The live history as one bounded JSON document (GET /dashboard/data, read by the page and by `conveyor top`).

- ``series``: columns over the samples after ``since``, at most ``MAX_POINTS`` of them: past that, consecutive
  samples merge into one point (rates and means between its first and last sample, gauges averaged, maxima kept),
  the newest sample always ending a point, so a client that asks ``since`` the ``seq`` it got last receives one or
  two new points a poll.
- ``now``: the newest sample with rates over the last ``RATE_WINDOW_S`` and per-stage p50 / p99 latencies,
  prefix-cache hit rate and draft acceptance over the last ``window_s``.
- ``steps``: the last ``RECENT_STEPS`` device steps one by one.

Quantiles come from the stages' latency buckets, interpolated inside a bucket (as Prometheus' histogram_quantile
does); past the last bound a quantile is that bound. A figure with nothing under it (no steps, no prompt looked
up, no drafts) is null, which plots as a gap.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipeline.live_stats import EngineReading, LiveSample, LiveStats, StageReading, StepRecord
from pipeline.stage import LATENCY_BUCKETS

VERSION = 1
MAX_POINTS = 300
RECENT_STEPS = 240
RATE_WINDOW_S = 5.0

Number = float | int | None
# the columns of ``series`` (each point's figures: `_interval`), and each stage's
SERIES = ("t", "tokens_per_s", "prompt_tokens_per_s", "steps_per_s", "step_ms", "step_ms_max", "device_busy",
          "decode_rows", "verify_rows", "prompt_tokens", "running", "waiting", "prefilling", "kv_blocks_used",
          "state_slots_used", "snapshots_held", "prefix_hit_rate", "spec_acceptance")
STAGE_SERIES = ("inbox", "in_per_s", "out_per_s", "queue_wait_p99_ms", "service_p99_ms")


def bucket_quantile(counts: Sequence[int], q: float, bounds: Sequence[float] = LATENCY_BUCKETS) -> float | None:
    """The q-quantile of observations given as per-bucket counts (``bounds`` then an overflow bucket); None when
    there are none."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    below = 0
    for index, count in enumerate(counts):
        if count > 0 and below + count >= rank:
            if index >= len(bounds):
                return bounds[-1]
            lower = bounds[index - 1] if index else 0.0
            return lower + (bounds[index] - lower) * (rank - below) / count
        below += count
    return bounds[-1]


def _difference(newer: Sequence[int], older: Sequence[int]) -> list[int]:
    return [a - b for a, b in zip(newer, older)]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 4)


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _rounded(value: Number, digits: int = 3) -> Number:
    return round(value, digits) if isinstance(value, float) else value


def _stage_latencies(newer: StageReading, older: StageReading) -> dict[str, dict[str, float | None]]:
    wait, service = _difference(newer.queue_wait, older.queue_wait), _difference(newer.service, older.service)
    return {"queue_wait_ms": {"p50": _ms(bucket_quantile(wait, 0.5)), "p99": _ms(bucket_quantile(wait, 0.99))},
            "service_ms": {"p50": _ms(bucket_quantile(service, 0.5)), "p99": _ms(bucket_quantile(service, 0.99))}}


def _interval(older: LiveSample, newer: LiveSample, merged: Sequence[LiveSample]) -> dict[str, Any]:
    """The figures of one plotted point: what happened between ``older`` and ``newer`` (``merged``: the samples
    after ``older`` up to ``newer``)."""
    a, b = older.reading, newer.reading
    dt = max(newer.mono - older.mono, 1e-9)
    steps = newer.steps.steps - older.steps.steps

    def mean(gauge: Callable[[EngineReading], int]) -> float:
        return sum(gauge(sample.reading) for sample in merged) / len(merged)

    stages = {}
    for name, stage in b.stages.items():
        before = a.stages.get(name, stage)
        stages[name] = {"inbox": mean(lambda r: r.stages[name].inbox if name in r.stages else 0),
                        "in_per_s": (stage.items_in - before.items_in) / dt,
                        "out_per_s": (stage.items_out - before.items_out) / dt,
                        "queue_wait_p99_ms": _ms(bucket_quantile(_difference(stage.queue_wait, before.queue_wait),
                                                                 0.99)),
                        "service_p99_ms": _ms(bucket_quantile(_difference(stage.service, before.service), 0.99))}
    return {
        "t": newer.wall,
        "tokens_per_s": (b.picked_tokens - a.picked_tokens) / dt,
        "prompt_tokens_per_s": (newer.steps.prompt_tokens - older.steps.prompt_tokens) / dt,
        "steps_per_s": steps / dt,
        "step_ms": _ratio(newer.steps.step_ms - older.steps.step_ms, steps),
        "step_ms_max": max(sample.longest_step_ms for sample in merged) if steps else None,
        "device_busy": min(1.0, (newer.steps.busy_ms - older.steps.busy_ms) / (dt * 1000.0)),
        "decode_rows": _ratio(newer.steps.decode_rows - older.steps.decode_rows, steps),
        "verify_rows": _ratio(newer.steps.verify_rows - older.steps.verify_rows, steps),
        "prompt_tokens": _ratio(newer.steps.prompt_tokens - older.steps.prompt_tokens, steps),
        "running": mean(lambda r: r.running),
        "waiting": mean(lambda r: r.waiting_requests),
        "prefilling": mean(lambda r: r.prefilling),
        "kv_blocks_used": mean(lambda r: r.kv_blocks_used),
        "state_slots_used": mean(lambda r: r.state_slots_used),
        "snapshots_held": mean(lambda r: r.snapshots_held),
        "prefix_hit_rate": _ratio(b.prefix_hit_tokens - a.prefix_hit_tokens,
                                  b.prefix_queried_tokens - a.prefix_queried_tokens),
        "spec_acceptance": _ratio(b.accepted_tokens - a.accepted_tokens, b.drafted_tokens - a.drafted_tokens),
        "stages": stages,
    }


def _point_ends(first: int, last: int, max_points: int) -> list[int]:
    """Indices of the samples that end each point, for the samples after index ``first`` up to ``last``: every
    sample while they are few, else every stride-th counted back from the newest."""
    count = last - first
    if count <= 0:
        return []
    stride = -(-count // max_points)
    return list(range(last, first, -stride))[::-1]


def _columns(points: list[dict[str, Any]], stage_names: Sequence[str]) -> dict[str, Any]:
    """Rows of figures to columns (what uPlot plots), rounded so a poll stays small; every column is there, empty
    when there are no points."""
    columns: dict[str, Any] = {key: [_rounded(point[key]) for point in points] for key in SERIES}
    columns["stages"] = {name: {field: [_rounded(point["stages"].get(name, {}).get(field)) for point in points]
                                for field in STAGE_SERIES}
                         for name in stage_names}
    return columns


def _sample_before(samples: Sequence[LiveSample], mono: float) -> LiveSample:
    """The newest sample taken at or before ``mono`` (the oldest kept if none is)."""
    chosen = samples[0]
    for sample in samples:
        if sample.mono > mono:
            break
        chosen = sample
    return chosen


def _now(samples: Sequence[LiveSample], window_s: float) -> dict[str, Any] | None:
    if not samples:
        return None
    newest = samples[-1]
    reading = newest.reading
    rated = _interval(_sample_before(samples, newest.mono - RATE_WINDOW_S), newest, [newest]) \
        if len(samples) > 1 else None
    windowed = _sample_before(samples, newest.mono - window_s)
    span = windowed.reading
    stages = {}
    for name, stage in reading.stages.items():
        rates = rated["stages"][name] if rated is not None else {}
        stages[name] = {"inbox": stage.inbox, "in_per_s": _rounded(rates.get("in_per_s")),
                        "out_per_s": _rounded(rates.get("out_per_s")),
                        **_stage_latencies(stage, span.stages.get(name, stage))}
    figures = {key: _rounded(rated[key]) if rated is not None else None
               for key in ("tokens_per_s", "prompt_tokens_per_s", "steps_per_s", "step_ms", "device_busy",
                           "decode_rows", "verify_rows", "prompt_tokens")}
    return {
        "t": newest.wall,
        "window_s": round(newest.mono - windowed.mono, 3),
        **figures,
        "running": reading.running,
        "waiting": reading.waiting_requests,
        "waiting_tokens": reading.waiting_tokens,
        "prefilling": reading.prefilling,
        "seats_held": reading.seats_held,
        "kv_blocks_used": reading.kv_blocks_used,
        "state_slots_used": reading.state_slots_used,
        "snapshots_held": reading.snapshots_held,
        "preemptions": reading.preemptions,
        "device_steps": newest.steps.steps,
        "prefix_hit_rate": _rounded(_ratio(reading.prefix_hit_tokens - span.prefix_hit_tokens,
                                           reading.prefix_queried_tokens - span.prefix_queried_tokens), 4),
        "spec_acceptance": _rounded(_ratio(reading.accepted_tokens - span.accepted_tokens,
                                           reading.drafted_tokens - span.drafted_tokens), 4),
        "stages": stages,
    }


def _recent_steps(records: Sequence[StepRecord], wall_offset: float) -> dict[str, list[Number]]:
    chosen = list(records)[-RECENT_STEPS:]
    return {"t": [round(r.landed + wall_offset, 4) for r in chosen], "ms": [round(r.ms, 3) for r in chosen],
            "decode_rows": [r.decode_rows for r in chosen], "verify_rows": [r.verify_rows for r in chosen],
            "draft_tokens": [r.draft_tokens for r in chosen], "prompt_tokens": [r.prompt_tokens for r in chosen]}


def live_payload(live: LiveStats, info: dict[str, Any], since: int = 0, window_s: float = 60.0,
                 max_points: int = MAX_POINTS) -> dict[str, Any]:
    """The document for a client that has the samples up to ``since`` (0: none)."""
    samples = list(live.samples)
    if samples and since > samples[-1].seq:  # numbers of another engine's history (the server restarted)
        since = 0
    stage_names = list(info.get("stages", ()))
    first = 0  # index of the sample the first point's differences start from
    for index, sample in enumerate(samples):
        if sample.seq <= since:
            first = index
    points = []
    previous = first
    for end in _point_ends(first, len(samples) - 1, max_points):
        points.append(_interval(samples[previous], samples[end], samples[previous + 1:end + 1]))
        previous = end
    return {
        "version": VERSION,
        "seq": samples[-1].seq if samples else 0,
        "started": live.started,
        "interval_s": live.interval_s,
        "info": {**info, "history_s": live.samples.maxlen * live.interval_s, "max_points": max_points},
        "now": _now(samples, window_s),
        "series": _columns(points, stage_names),
        "steps": _recent_steps(live.steps, live.wall_offset),
    }
