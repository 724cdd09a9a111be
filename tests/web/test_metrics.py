"""web/metrics.py: every series present with model_name, observations move, stage histograms convert."""
from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.errors import AdmissionRefused
from pipeline.request import FinishReason
from pipeline.scheduler import WaitingGauge
from pipeline.stage import Stage
from web.metrics import ADMISSION_REASONS, FINISH_REASONS, ServerMetrics, admission_reason, cumulative_buckets

MODEL = "tiny-model"
STAGE_NAMES = ("intake", "prefill", "decode", "verify", "detokenize", "stream")


def make_stages() -> list[Stage]:
    """Real Stage objects with known observations, so the snapshot shape is the engine's own."""
    stages = []
    for i, name in enumerate(STAGE_NAMES):
        stage = Stage(inbox_size=4)
        stage.name = name
        for value in (0.0001, 0.0003, 0.002 * (i + 1), 0.25, 99.0):  # an exact bound, and one past the last
            stage.metrics.queue_wait.observe(value)
        stage.metrics.service_time.observe(0.01 * (i + 1))
        for batch in (1, 3, 4, 600):
            stage.metrics.batch_size.observe(batch)
        stage.metrics.items_out = 7 * i
        for _ in range(i % 3):
            asyncio.run(stage.put(object()))
        stages.append(stage)
    return stages


def make_stats(stages: list[Stage]) -> dict[str, Any]:
    """Mirrors Engine.stats()."""
    return {
        "stages": {stage.name: stage.snapshot() for stage in stages},
        "kv_blocks": {"total": 200, "used": 50, "free": 150, "cached_free": 30},
        "prefix_cache": {"enabled": True, "queried_tokens": 900, "hit_tokens": 320, "evictions": 4},
        "seats": {"capacity": 8, "held": 3},
        "waiting": {"requests": 2, "tokens": 345},
        "running": 3,
        "prefilling": 1,
        "preemptions": 4,
        "device_steps": 1000,
        "mixed_steps": 120,
    }


def scrape(metrics: ServerMetrics) -> dict[str, Any]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def value(families: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    labels = {"model_name": MODEL, **labels}
    matches = [s.value for s in families[family].samples if s.name == sample and s.labels == labels]
    assert len(matches) == 1, (family, sample, labels)
    return matches[0]


@pytest.fixture
def stages() -> list[Stage]:
    return make_stages()


@pytest.fixture
def metrics(stages: list[Stage]) -> ServerMetrics:
    return ServerMetrics(lambda: make_stats(stages), MODEL)


EXPECTED = {
    "conveyor_requests": "counter", "conveyor_prompt_tokens": "counter", "conveyor_generation_tokens": "counter",
    "conveyor_time_to_first_token_seconds": "histogram", "conveyor_inter_token_latency_seconds": "histogram",
    "conveyor_e2e_request_latency_seconds": "histogram", "conveyor_admission_rejections": "counter",
    "conveyor_num_requests_running": "gauge", "conveyor_num_requests_prefilling": "gauge",
    "conveyor_num_requests_waiting": "gauge", "conveyor_waiting_prompt_tokens": "gauge",
    "conveyor_kv_blocks_used": "gauge", "conveyor_kv_blocks_total": "gauge", "conveyor_kv_cache_usage_ratio": "gauge",
    "conveyor_seats_held": "gauge", "conveyor_seats_capacity": "gauge", "conveyor_preemptions": "counter",
    "conveyor_device_steps": "counter", "conveyor_mixed_steps": "counter",
    "conveyor_kv_blocks_cached_free": "gauge", "conveyor_prefix_cache_queries": "counter",
    "conveyor_prefix_cache_hits": "counter", "conveyor_prefix_cache_evictions": "counter",
    "conveyor_stage_queue_wait_seconds": "histogram", "conveyor_stage_service_time_seconds": "histogram",
    "conveyor_stage_batch_size": "histogram", "conveyor_stage_items_in": "counter",
    "conveyor_stage_items_out": "counter", "conveyor_stage_inbox_depth": "gauge",
}


def test_every_metric_present_with_model_label(metrics: ServerMetrics) -> None:
    families = scrape(metrics)
    for name, kind in EXPECTED.items():
        assert name in families, name
        assert families[name].type == kind, name
        assert families[name].samples, name
        assert all(s.labels.get("model_name") == MODEL for s in families[name].samples), name
    assert all(name.startswith("conveyor_") for name in families)
    for reason in FINISH_REASONS:  # pre-created at zero
        assert value(families, "conveyor_requests", "conveyor_requests_total", finish_reason=reason) == 0
    for reason in ADMISSION_REASONS:
        assert value(families, "conveyor_admission_rejections", "conveyor_admission_rejections_total",
                     reason=reason) == 0


def test_engine_gauges_and_counters(metrics: ServerMetrics) -> None:
    f = scrape(metrics)
    assert value(f, "conveyor_num_requests_running", "conveyor_num_requests_running") == 3
    assert value(f, "conveyor_num_requests_prefilling", "conveyor_num_requests_prefilling") == 1
    assert value(f, "conveyor_num_requests_waiting", "conveyor_num_requests_waiting") == 2
    assert value(f, "conveyor_waiting_prompt_tokens", "conveyor_waiting_prompt_tokens") == 345
    assert value(f, "conveyor_kv_blocks_used", "conveyor_kv_blocks_used") == 50
    assert value(f, "conveyor_kv_blocks_total", "conveyor_kv_blocks_total") == 200
    assert value(f, "conveyor_kv_blocks_cached_free", "conveyor_kv_blocks_cached_free") == 30
    assert value(f, "conveyor_prefix_cache_hits", "conveyor_prefix_cache_hits_total") == 320
    assert value(f, "conveyor_prefix_cache_queries", "conveyor_prefix_cache_queries_total") == 900
    assert value(f, "conveyor_kv_cache_usage_ratio", "conveyor_kv_cache_usage_ratio") == pytest.approx(0.25)
    assert value(f, "conveyor_seats_held", "conveyor_seats_held") == 3
    assert value(f, "conveyor_preemptions", "conveyor_preemptions_total") == 4
    assert value(f, "conveyor_device_steps", "conveyor_device_steps_total") == 1000
    assert value(f, "conveyor_mixed_steps", "conveyor_mixed_steps_total") == 120


def test_empty_kv_pool_ratio_is_zero(stages: list[Stage]) -> None:
    stats = make_stats(stages)
    stats["kv_blocks"] = {"total": 0, "used": 0, "free": 0, "cached_free": 0}
    f = scrape(ServerMetrics(lambda: stats, MODEL))
    assert value(f, "conveyor_kv_cache_usage_ratio", "conveyor_kv_cache_usage_ratio") == 0


def expected_cumulative(snapshot: dict[str, Any]) -> list[tuple[float, float]]:
    running, out = 0, []
    for bound, count in snapshot["buckets"].items():
        running += count
        out.append((float(bound), float(running)))
    return out


@pytest.mark.parametrize("key,family", [("queue_wait_s", "conveyor_stage_queue_wait_seconds"),
                                        ("service_time_s", "conveyor_stage_service_time_seconds"),
                                        ("batch_size", "conveyor_stage_batch_size")])
def test_stage_histograms_match_snapshot(metrics: ServerMetrics, stages: list[Stage], key: str, family: str) -> None:
    f = scrape(metrics)
    for stage in stages:
        snap = stage.snapshot()[key]
        buckets = [s for s in f[family].samples if s.name == f"{family}_bucket" and s.labels["stage"] == stage.name]
        got = sorted((float(s.labels["le"]), s.value) for s in buckets)
        assert got == expected_cumulative(snap)
        assert math.isinf(got[-1][0]) and got[-1][1] == snap["count"]
        assert value(f, family, f"{family}_count", stage=stage.name) == snap["count"]
        assert value(f, family, f"{family}_sum", stage=stage.name) == pytest.approx(snap["sum"])
    # Spot-check le semantics: 0.0001 sits in le="0.0001"; 0.0003 first counts at le="0.0005"; 99 only at +Inf.
    if key == "queue_wait_s":
        assert value(f, family, f"{family}_bucket", stage="intake", le="0.0001") == 1
        assert value(f, family, f"{family}_bucket", stage="intake", le="0.00025") == 1
        assert value(f, family, f"{family}_bucket", stage="intake", le="0.0005") == 2
        assert value(f, family, f"{family}_bucket", stage="intake", le="10.0") == 4
        assert value(f, family, f"{family}_bucket", stage="intake", le="+Inf") == 5


def test_stage_counters_and_depth(metrics: ServerMetrics, stages: list[Stage]) -> None:
    f = scrape(metrics)
    for stage in stages:
        snap = stage.snapshot()
        assert value(f, "conveyor_stage_items_in", "conveyor_stage_items_in_total",
                     stage=stage.name) == snap["items_in"]
        assert value(f, "conveyor_stage_items_out", "conveyor_stage_items_out_total",
                     stage=stage.name) == snap["items_out"]
        assert value(f, "conveyor_stage_inbox_depth", "conveyor_stage_inbox_depth",
                     stage=stage.name) == snap["inbox_depth"]
    assert value(f, "conveyor_stage_inbox_depth", "conveyor_stage_inbox_depth", stage="prefill") == 1


def test_engine_stats_read_at_scrape_time(stages: list[Stage]) -> None:
    stats = make_stats(stages)
    metrics = ServerMetrics(lambda: stats, MODEL)
    stats["running"] = 9
    assert value(scrape(metrics), "conveyor_num_requests_running", "conveyor_num_requests_running") == 9


def test_request_observations_move(metrics: ServerMetrics) -> None:
    metrics.request_finished("stop", prompt_tokens=10, generation_tokens=5, ttft_s=0.02, e2e_s=0.3)
    metrics.request_finished(FinishReason.LENGTH, prompt_tokens=7, generation_tokens=3, ttft_s=None, e2e_s=1.5)
    metrics.inter_token_latency(0.004)
    metrics.inter_token_latency(0.03, tokens=3)  # three gaps of 10 ms
    metrics.inter_token_latency(0.5, tokens=0)  # no tokens: ignored
    metrics.admission_rejected("waiting_tokens")
    metrics.admission_rejected("some free-text message")
    f = scrape(metrics)
    assert value(f, "conveyor_requests", "conveyor_requests_total", finish_reason="stop") == 1
    assert value(f, "conveyor_requests", "conveyor_requests_total", finish_reason="length") == 1
    assert value(f, "conveyor_prompt_tokens", "conveyor_prompt_tokens_total") == 17
    assert value(f, "conveyor_generation_tokens", "conveyor_generation_tokens_total") == 8
    ttft = "conveyor_time_to_first_token_seconds"
    assert value(f, ttft, f"{ttft}_count") == 1  # the ttft=None request is not observed
    assert value(f, ttft, f"{ttft}_sum") == pytest.approx(0.02)
    assert value(f, ttft, f"{ttft}_bucket", le="0.025") == 1 and value(f, ttft, f"{ttft}_bucket", le="0.01") == 0
    e2e = "conveyor_e2e_request_latency_seconds"
    assert value(f, e2e, f"{e2e}_count") == 2 and value(f, e2e, f"{e2e}_sum") == pytest.approx(1.8)
    assert value(f, e2e, f"{e2e}_bucket", le="0.001") == 0 and value(f, e2e, f"{e2e}_bucket", le="60.0") == 2
    itl = "conveyor_inter_token_latency_seconds"
    assert value(f, itl, f"{itl}_count") == 4 and value(f, itl, f"{itl}_sum") == pytest.approx(0.034)
    assert value(f, itl, f"{itl}_bucket", le="0.005") == 1 and value(f, itl, f"{itl}_bucket", le="0.01") == 4
    rej = "conveyor_admission_rejections"
    assert value(f, rej, f"{rej}_total", reason="waiting_tokens") == 1
    assert value(f, rej, f"{rej}_total", reason="other") == 1


def test_admission_reason_classifies_engine_messages() -> None:
    gauge = WaitingGauge(max_requests=1, max_tokens=10, requests=1)
    assert admission_reason(AdmissionRefused(gauge.refusal(1))) == "waiting_requests"
    gauge = WaitingGauge(max_requests=5, max_tokens=10, tokens=8)
    assert admission_reason(AdmissionRefused(gauge.refusal(5))) == "waiting_tokens"
    assert admission_reason(AdmissionRefused("the server is shutting down")) == "draining"
    assert admission_reason(AdmissionRefused("something else")) == "other"


def test_two_instances_do_not_collide(stages: list[Stage]) -> None:
    a = ServerMetrics(lambda: make_stats(stages), MODEL)
    b = ServerMetrics(lambda: make_stats(stages), MODEL)  # same names: would raise on a shared registry
    a.request_finished("stop", 1, 1, 0.1, 0.2)
    assert value(scrape(a), "conveyor_requests", "conveyor_requests_total", finish_reason="stop") == 1
    assert value(scrape(b), "conveyor_requests", "conveyor_requests_total", finish_reason="stop") == 0
    from prometheus_client import REGISTRY
    assert not any(name.startswith("conveyor_") for name in REGISTRY._names_to_collectors)


def test_failing_engine_stats_keeps_request_series() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("engine stopped")

    metrics = ServerMetrics(broken, MODEL)
    metrics.request_finished("error", 3, 0, None, 0.01)
    f = scrape(metrics)
    assert value(f, "conveyor_requests", "conveyor_requests_total", finish_reason="error") == 1
    assert "conveyor_kv_blocks_used" not in f


def test_cumulative_buckets_adds_missing_inf() -> None:
    assert cumulative_buckets({"2": 1, "1": 2}) == [("1.0", 2.0), ("2.0", 3.0), ("+Inf", 3.0)]
    assert cumulative_buckets({"1": 2, "+Inf": 1}) == [("1.0", 2.0), ("+Inf", 3.0)]



def test_speculation_and_snapshot_tier_families(stages: list[Stage]) -> None:
    """Drafts offered and accepted per drafter with the acceptance-length histogram; snapshots by tier."""
    stats = make_stats(stages)
    stats["speculation"] = {"method": "ngram", "verify_rows": 10, "drafted_tokens": 30, "accepted_tokens": 12,
                            "accepted_per_row": [4, 3, 1, 2]}
    stats["state_snapshots"] = {"enabled": True, "held": 2, "taken": 9, "restored": 3,
                                "host": {"held": 5, "demoted": 7, "promoted": 2}}
    f = scrape(ServerMetrics(lambda: stats, MODEL))
    assert value(f, "conveyor_spec_drafted_tokens", "conveyor_spec_drafted_tokens_total", drafter="ngram") == 30
    assert value(f, "conveyor_spec_accepted_tokens", "conveyor_spec_accepted_tokens_total", drafter="ngram") == 12
    assert value(f, "conveyor_spec_verify_rows", "conveyor_spec_verify_rows_total", drafter="ngram") == 10
    hist = "conveyor_spec_acceptance_length"
    assert value(f, hist, hist + "_bucket", drafter="ngram", le="0") == 4
    assert value(f, hist, hist + "_bucket", drafter="ngram", le="2") == 8
    assert value(f, hist, hist + "_bucket", drafter="ngram", le="+Inf") == 10
    assert value(f, hist, hist + "_sum", drafter="ngram") == 3 + 2 + 6
    assert value(f, "conveyor_state_snapshots_held_tier", "conveyor_state_snapshots_held_tier", tier="host") == 5
    moved = "conveyor_state_snapshots_moved"
    assert value(f, moved, moved + "_total", direction="to_host") == 7
    assert value(f, moved, moved + "_total", direction="to_device") == 2
    assert "conveyor_spec_drafted_tokens" not in scrape(ServerMetrics(lambda: make_stats(stages), MODEL))
