"""Made-up engine readings at known rates and a hand-driven clock, for tests of the dashboard's history
(pipeline/live_stats.py), its JSON view (pipeline/live_view.py) and what `conveyor top` draws of it (cli/top.py)."""
from __future__ import annotations

from pipeline.live_stats import EngineReading, LiveStats, StageReading
from pipeline.stage import LATENCY_BUCKETS

STAGES = ("intake", "prefill", "decode", "verify", "detokenize", "stream")
INFO = {"stages": list(STAGES), "kv_blocks_total": 100}


class Clock:
    """What LiveStats reads as time.monotonic(): moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def buckets(*values: float) -> tuple[int, ...]:
    counts = [0] * (len(LATENCY_BUCKETS) + 1)
    for value in values:
        counts[next((i for i, bound in enumerate(LATENCY_BUCKETS) if value <= bound), len(LATENCY_BUCKETS))] += 1
    return tuple(counts)


def reading(second: int, running: int = 4, waits: tuple[float, ...] = ()) -> EngineReading:
    """Counters growing at known rates: 50 picked tokens, 10 stage items in and 9 out, 8 prompt tokens looked up
    of which 2 hit, 4 drafts of which 3 accepted, and the latencies ``waits``, each second."""
    latencies = tuple(count * second for count in buckets(*waits))  # cumulative: ``waits`` again each second
    stage = StageReading(10 * second, 9 * second, second % 3, latencies, latencies)
    return EngineReading({name: stage for name in STAGES}, running, 1, 2, 30, running, 40, 0, 0,
                         picked_tokens=50 * second, prefix_queried_tokens=8 * second, prefix_hit_tokens=2 * second,
                         drafted_tokens=4 * second, accepted_tokens=3 * second, preemptions=0)


def filled(seconds: int) -> tuple[LiveStats, Clock]:
    """A history of ``seconds`` samples a second apart, with 4 ms queue waits and a 200 ms one in each second."""
    clock = Clock()
    live = LiveStats(clock=clock, history=seconds)
    for second in range(seconds):
        live.take_sample(reading(second, running=second % 7, waits=(0.004,) * 10 + (0.2,)))
        clock.now += 1.0
    return live, clock
