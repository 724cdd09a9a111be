"""The dashboard's history (pipeline/live_stats.py) and its JSON view (pipeline/live_view.py), without an engine: steps
reported as the planner reports them, under a hand-driven clock, and readings made up to known rates."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from pipeline.live_stats import LiveStats
from pipeline.live_view import MAX_POINTS, RECENT_STEPS, bucket_quantile, live_payload
from pipeline.runner.step_plan import ScheduledChunk
from pipeline.stage import LATENCY_BUCKETS
from tests.live_history import INFO, STAGES, Clock, buckets, filled, reading


class Launched:
    """What the planner hands over: a launched step whose future the device thread settles."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.launched: asyncio.Future[object] = loop.create_future()


def chunk(tokens: int, picks: int = 1) -> ScheduledChunk:
    return ScheduledChunk(list(range(tokens)), 0, [], [object()] * picks)


def test_bucket_quantiles_interpolate_inside_a_bucket_and_stop_at_the_last_bound() -> None:
    assert bucket_quantile([0] * (len(LATENCY_BUCKETS) + 1), 0.5) is None
    counts = list(buckets(0.004, 0.004, 0.004, 0.004))  # all in (0.0025, 0.005]
    assert 0.0025 < bucket_quantile(counts, 0.5) <= 0.005
    assert bucket_quantile(counts, 0.5) < bucket_quantile(counts, 0.99)
    assert bucket_quantile(buckets(0.0005, 0.0005, 99.0, 99.0), 0.99) == LATENCY_BUCKETS[-1]
    assert bucket_quantile(buckets(*[0.0003] * 99, 3.0), 0.5) <= 0.0005


def test_steps_are_recorded_with_their_makeup_and_the_device_time_they_took() -> None:
    async def main() -> None:
        loop, clock = asyncio.get_running_loop(), Clock()
        live = LiveStats(clock=clock)
        first, second = Launched(loop), Launched(loop)
        # a mixed step: three decode rows, one of them verifying three drafts (four picks), and a prompt chunk
        live.step_launched(first, [chunk(1), chunk(4, picks=4), chunk(1)], [chunk(20)], decode_picks=6)
        clock.now += 0.5
        live.step_launched(second, [chunk(1)], [], decode_picks=1)  # queued behind the first
        clock.now += 0.3
        first.launched.set_result(object())
        await asyncio.sleep(0)  # the future's callbacks run on the next loop pass
        clock.now += 0.2
        live.take_sample(reading(1))  # the second step is on the device thread since the first landed
        clock.now += 0.6
        second.launched.set_result(object())
        await asyncio.sleep(0)
        clock.now += 0.4
        live.take_sample(reading(2))

        one, two = live.steps
        assert (one.decode_rows, one.verify_rows, one.draft_tokens, one.prompt_tokens) == (3, 1, 3, 20)
        assert (two.decode_rows, two.verify_rows, two.draft_tokens, two.prompt_tokens) == (1, 0, 0, 0)
        assert one.ms == pytest.approx(800.0) and two.ms == pytest.approx(800.0)  # from the first's landing on
        earlier, later = live.samples
        assert earlier.steps.steps == 1 and later.steps.steps == 2
        assert earlier.steps.busy_ms == pytest.approx(1000.0)  # all of the first second
        assert later.steps.busy_ms - earlier.steps.busy_ms == pytest.approx(600.0)  # the rest of the second step
        assert later.steps.step_ms == pytest.approx(1600.0)
        assert later.longest_step_ms == pytest.approx(800.0)

    asyncio.run(main())


def test_a_failed_launch_is_not_a_step() -> None:
    async def main() -> None:
        live = LiveStats(clock=Clock())
        step = Launched(asyncio.get_running_loop())
        live.step_launched(step, [chunk(1)], [], decode_picks=1)
        step.launched.set_exception(RuntimeError("device lost"))
        await asyncio.sleep(0)
        assert not live.steps
        live.take_sample(reading(1))
        assert live.samples[-1].steps.busy_ms == 0.0  # nothing in flight any more

    asyncio.run(main())


def test_the_view_merges_old_samples_into_at_most_max_points_and_keeps_rates_exact() -> None:
    live, _ = filled(600)
    payload = live_payload(live, INFO, since=0, window_s=60.0)
    series = payload["series"]
    assert payload["seq"] == 600 and 150 <= len(series["t"]) <= MAX_POINTS
    assert series["t"][-1] == pytest.approx(live.samples[-1].wall)  # the newest sample ends the last point
    assert all(len(column) == len(series["t"]) for key, column in series.items() if key != "stages")
    assert set(series["stages"]) == set(STAGES)
    assert all(len(column) == len(series["t"]) for stage in series["stages"].values() for column in stage.values())
    assert set(series["tokens_per_s"]) == {50.0}
    assert set(series["stages"]["decode"]["in_per_s"]) == {10.0}
    assert set(series["prefix_hit_rate"]) == {0.25} and set(series["spec_acceptance"]) == {0.75}
    assert set(series["step_ms"]) == {None}  # no steps: nothing to average
    assert max(series["running"]) <= 6
    assert len(orjson.dumps(payload)) < 200_000


def test_a_client_gets_only_what_came_after_the_sample_it_has() -> None:
    live, clock = filled(30)
    assert len(live_payload(live, INFO, since=0)["series"]["t"]) == 29  # every sample but the first: few, unmerged
    assert len(live_payload(live, INFO, since=27)["series"]["t"]) == 3
    assert live_payload(live, INFO, since=30)["series"]["t"] == []
    # numbers of another engine's history: this one's, whole
    assert len(live_payload(live, INFO, since=10_000)["series"]["t"]) == 29


def test_now_has_rates_and_latency_quantiles_over_the_window() -> None:
    live, _ = filled(120)
    now = live_payload(live, INFO, window_s=60.0)["now"]
    assert now["tokens_per_s"] == pytest.approx(50.0)
    assert now["window_s"] == pytest.approx(60.0)
    decode = now["stages"]["decode"]
    assert decode["in_per_s"] == pytest.approx(10.0) and decode["out_per_s"] == pytest.approx(9.0)
    assert 2.5 < decode["queue_wait_ms"]["p50"] <= 5.0 and 100.0 < decode["queue_wait_ms"]["p99"] <= 250.0
    assert now["prefix_hit_rate"] == pytest.approx(0.25) and now["spec_acceptance"] == pytest.approx(0.75)
    assert now["running"] == 119 % 7


def test_an_empty_history_is_a_valid_document() -> None:
    payload = live_payload(LiveStats(), INFO)
    assert payload["seq"] == 0 and payload["now"] is None and payload["series"]["t"] == []
    assert payload["steps"]["t"] == []


def test_recent_steps_are_bounded() -> None:
    async def main() -> None:
        clock = Clock()
        live = LiveStats(clock=clock)
        loop = asyncio.get_running_loop()
        for _ in range(RECENT_STEPS + 50):
            step = Launched(loop)
            live.step_launched(step, [chunk(1)] * 8, [], decode_picks=8)
            clock.now += 0.01
            step.launched.set_result(object())
            await asyncio.sleep(0)
        steps = live_payload(live, INFO)["steps"]
        assert len(steps["t"]) == RECENT_STEPS and set(steps["decode_rows"]) == {8}
        assert steps["ms"][-1] == pytest.approx(10.0)

    asyncio.run(main())
