"""Where a profiled run's device sat idle: a Chrome trace from torch.profiler (``bench/spec.py --profile``) read for
its kernels' busy time, the gaps between them, and the host ops that ran during the longest gaps. JSON out.

    python3 bench/trace_gaps.py $OUT/spec-trace.json --out $OUT/spec-gaps.json
"""
from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict


def load(path: str) -> tuple[list[tuple[float, float, str]], list[tuple[float, float, str, int]]]:
    """(start, end, name) of every kernel or device copy, sorted; (start, end, name, thread) of every host op."""
    with open(path) as handle:
        events = json.load(handle)["traceEvents"]
    kernels, host = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", ""))
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(span)
        elif e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "python_function"):
            host.append(span + (e.get("tid", 0),))
    kernels.sort()
    return kernels, host


def gaps(kernels: list[tuple[float, float, str]], floor_us: float) -> tuple[float, float, list[tuple[float, float]]]:
    """Busy time (the kernels' union), the window, and the idle gaps of at least ``floor_us``."""
    busy, found = 0.0, []
    start, end = kernels[0][0], kernels[0][1]
    window = (kernels[0][0], max(k[1] for k in kernels))
    for s, e, _ in kernels[1:]:
        if s > end:
            busy += end - start
            if s - end >= floor_us:
                found.append((end, s))
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return busy, window[1] - window[0], found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--floor-us", type=float, default=20.0, help="shorter idle spans are not counted as gaps")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sequence-us", type=float, default=8000.0,
                    help="how long a stretch after the window's midpoint ``middle_sequence`` lists")
    a = ap.parse_args()
    kernels, host = load(a.trace)
    busy, window, found = gaps(kernels, a.floor_us)
    idle = sum(e - s for s, e in found)
    # the host ops that overlap the gaps, by name: what the device waited on
    during: dict[str, float] = defaultdict(float)
    for s, e in found:
        for hs, he, name, _ in host:
            overlap = min(e, he) - max(s, hs)
            if overlap > 0:
                during[name] += overlap
    sizes = Counter(min(int((e - s) // 100) * 100, 5000) for s, e in found)
    report = dict(window_ms=window / 1e3, busy_ms=busy / 1e3, idle_in_gaps_ms=idle / 1e3, gaps=len(found),
                  floor_us=a.floor_us, gap_histogram_us={f"{k}-{k + 100}": v for k, v in sorted(sizes.items())},
                  host_ops_during_gaps_ms={k: round(v / 1e3, 3) for k, v in
                                           sorted(during.items(), key=lambda kv: -kv[1])[:40]},
                  kernels_ms={k: round(v / 1e3, 3) for k, v in sorted(
                      _by_name(kernels).items(), key=lambda kv: -kv[1])[:30]},
                  middle_gaps=_middle(kernels, found), middle_sequence=_sequence(kernels, a.sequence_us))
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as handle:
            handle.write(text)


def _middle(kernels: list[tuple[float, float, str]], found: list[tuple[float, float]], count: int = 12) -> list:
    """The gaps after the window's midpoint, each with the kernel before and after it: one cycle's pattern."""
    middle = (kernels[0][0] + kernels[-1][1]) / 2
    ends = {e: name for _, e, name in kernels}
    starts = {s: name for s, _, name in kernels}
    chosen = [g for g in found if g[0] >= middle][:count]
    return [dict(at_us=round(s - chosen[0][0], 1), idle_us=round(e - s, 1), after=ends.get(s, "")[:60],
                 before=starts.get(e, "")[:60]) for s, e in chosen]


def _triton(name: str) -> bool:
    """A Triton kernel's name: not a torch kernel (``void at::...``), a copy, a memset or a cuBLAS kernel."""
    return not (name.startswith(("void", "Memcpy", "Memset")) or "nvjet" in name or "::" in name)


def _sequence(kernels: list[tuple[float, float, str]], span_us: float) -> list:
    """The device ops of ``span_us`` after the window's midpoint in order: runs of Triton kernels (``_triton``) as
    one entry each, every other op (torch kernels, copies) alone, each with the idle time before it.
    Between two graph replays this shows what a step runs outside its graph and the gaps around it."""
    middle = (kernels[0][0] + kernels[-1][1]) / 2
    chosen = [k for k in kernels if middle <= k[0] < middle + span_us]
    out: list[dict] = []
    previous_end = chosen[0][0] if chosen else 0.0
    for s, e, name in chosen:
        idle = round(max(0.0, s - previous_end), 1)
        if _triton(name) and out and "triton" in out[-1] and idle < 5:
            run = out[-1]
            run["triton"] += 1
            run["us"] = round(e - run["_start"], 1)
            run["idle_inside_us"] = round(run["idle_inside_us"] + idle, 1)
        elif _triton(name):
            out.append(dict(triton=1, first=name[:40], us=round(e - s, 1), idle_before_us=idle, idle_inside_us=0.0,
                            _start=s))
        else:
            out.append(dict(op=name[:70], us=round(e - s, 1), idle_before_us=idle))
        previous_end = max(previous_end, e)
    for entry in out:
        entry.pop("_start", None)
    return out


def _by_name(kernels: list[tuple[float, float, str]]) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for s, e, name in kernels:
        total[name[:80]] += e - s
    return total


if __name__ == "__main__":
    main()
