"""Prometheus metrics for GET /metrics (docs/architecture.md, "Observability").

Two sources: per-request observations pushed by the HTTP layer (counters and histograms kept here),
and engine state pulled from `Engine.stats()` at scrape time by a custom collector, so the engine
never imports prometheus_client and the numbers are never stale. Every series is named
`conveyor_*` and carries a `model_name` label.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pipeline.stage import Histogram as BucketCounts

log = logging.getLogger("conveyor.metrics")

# 1 ms .. 60 s: fast GPU token gaps at the low end, slow CPU prompts and long generations at the top.
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "tool_calls")
# Label values must stay a small fixed set: free-text refusal messages would explode cardinality.
ADMISSION_REASONS: tuple[str, ...] = ("waiting_requests", "waiting_tokens", "draining", "other")

# (snapshot key, metric suffix, help) for the per-stage histograms in `Stage.snapshot()`.
_STAGE_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("queue_wait_s", "queue_wait_seconds", "Time a message waited in the stage inbox."),
    ("service_time_s", "service_time_seconds", "Time the stage spent on one step."),
    ("batch_size", "batch_size", "Messages handled per stage step."),
)


def admission_reason(exc: BaseException) -> str:
    """Map an AdmissionRefused message to an ADMISSION_REASONS label (messages: intake.py, scheduler.py)."""
    text = str(exc)
    if "shutting down" in text:
        return "draining"
    if "waiting requests" in text:
        return "waiting_requests"
    if "waiting prompt tokens" in text:
        return "waiting_tokens"
    return "other"


def _label(value: Any) -> str:
    """Enum members (FinishReason is a str Enum) must export their wire value, not 'FinishReason.STOP'."""
    return str(getattr(value, "value", value))


def cumulative_buckets(buckets: Mapping[str, int]) -> list[tuple[str, float]]:
    """Per-bucket counts (stage.Histogram, with a "+Inf" overflow bucket) to Prometheus `le` buckets.

    stage.Histogram uses bisect_left, so a value equal to a bound lands in that bound's bucket:
    exactly Prometheus' `le` semantics; only the running sum is needed.
    """
    ordered = sorted(buckets.items(), key=lambda kv: float(kv[0]))  # float("+Inf") == inf sorts last
    out: list[tuple[str, float]] = []
    running = 0
    for bound, count in ordered:
        running += count
        out.append((floatToGoString(float(bound)), float(running)))
    if not out or not math.isinf(float(ordered[-1][0])):
        out.append(("+Inf", float(running)))
    return out


class EngineStatsCollector(Collector):
    """Turns one `Engine.stats()` dict into metric families on every scrape."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self._engine_stats = engine_stats
        self._model = model_name

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._engine_stats()
            return list(self._families(stats)) if stats else []  # empty while the model loads: no engine yet
        except Exception:  # a dead or stopping engine must not break /metrics for the request series
            log.warning("engine stats unavailable for /metrics", exc_info=True)
            return []

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"conveyor_{name}", doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"conveyor_{name}", doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _by_label(self, family: type, name: str, doc: str, label: str, values: Mapping[str, float]) -> Metric:
        """One family of a value per ``label`` value (tiers, directions)."""
        metric = family(f"conveyor_{name}", doc, labels=["model_name", label])
        for key, value in values.items():
            metric.add_metric([self._model, key], value)
        return metric

    def _families(self, stats: Mapping[str, Any]) -> Iterable[Metric]:
        kv = stats["kv_blocks"]
        yield self._gauge("num_requests_running", "Sequences in the decode batch.", stats["running"])
        yield self._gauge("num_requests_prefilling", "Sequences waiting for or in prefill.", stats["prefilling"])
        yield self._gauge("num_requests_waiting", "Admitted requests not yet started.", stats["waiting"]["requests"])
        yield self._gauge("waiting_prompt_tokens", "Prompt tokens of waiting requests.", stats["waiting"]["tokens"])
        yield self._gauge("kv_blocks_used", "KV cache blocks in use.", kv["used"])
        yield self._gauge("kv_blocks_total", "KV cache blocks in the pool.", kv["total"])
        ratio = kv["used"] / kv["total"] if kv["total"] else 0.0
        yield self._gauge("kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).", ratio)
        yield self._gauge("kv_blocks_cached_free", "Free KV blocks still holding a cached prefix.", kv["cached_free"])
        prefix = stats["prefix_cache"]
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            prefix["queried_tokens"])
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", prefix["hit_tokens"])
        yield self._counter("prefix_cache_evictions", "Cached KV blocks evicted for new ones.", prefix["evictions"])
        yield from self._offload_families(stats.get("kv_offload", {}))
        snapshots = stats.get("state_snapshots", {})
        if snapshots.get("enabled"):
            yield self._gauge("state_snapshots_held", "Recurrent-state snapshots held (hybrid prefix cache).",
                              snapshots["held"])
            yield self._counter("state_snapshots_taken", "Recurrent states copied into a snapshot.", snapshots["taken"])
            yield self._counter("state_snapshots_restored", "Snapshots restored into a starting sequence.",
                                snapshots["restored"])
            if "host" in snapshots:
                host = snapshots["host"]
                yield self._by_label(GaugeMetricFamily, "state_snapshots_held_tier", "Snapshots held by tier.",
                                     "tier", {"device": snapshots["held"], "host": host["held"]})
                yield self._by_label(CounterMetricFamily, "state_snapshots_moved",
                                     "Snapshots demoted to host and promoted back to the device.", "direction",
                                     {"to_host": host["demoted"], "to_device": host["promoted"]})
        yield from self._speculation_families(stats.get("speculation", {}))
        yield self._gauge("seats_held", "Sequence seats held.", stats["seats"]["held"])
        yield self._gauge("seats_capacity", "Sequence seats in all (max_num_seqs).", stats["seats"]["capacity"])
        yield self._counter("preemptions", "Sequences preempted back to prefill.", stats["preemptions"])
        yield self._counter("device_steps", "Device executor steps.", stats["device_steps"])
        yield self._counter("mixed_steps", "Device steps that held both decode rows and prompt chunks.",
                            stats["mixed_steps"])
        yield from self._stage_families(stats["stages"])

    def _speculation_families(self, spec: Mapping[str, Any]) -> Iterable[Metric]:
        """Drafts offered and accepted, per drafter, and a histogram of how many of a verify row's were."""
        if not spec.get("method"):
            return
        labels = {"drafter": spec["method"]}
        for name, doc, key in (("spec_drafted_tokens", "Draft tokens verified.", "drafted_tokens"),
                               ("spec_accepted_tokens", "Draft tokens accepted.", "accepted_tokens"),
                               ("spec_verify_rows", "Sequence rows that verified drafts.", "verify_rows")):
            yield self._by_label(CounterMetricFamily, name, doc, "drafter", {labels["drafter"]: spec[key]})
        per_row = spec["accepted_per_row"]
        family = HistogramMetricFamily("conveyor_spec_acceptance_length", "Drafts accepted in a verify row.",
                                       labels=["model_name", "drafter"])
        buckets, total = [], 0
        for accepted, rows in enumerate(per_row):
            total += rows
            buckets.append((str(accepted) if accepted < len(per_row) - 1 else "+Inf", total))
        family.add_metric([self._model, spec["method"]], buckets, sum(a * r for a, r in enumerate(per_row)))
        yield family

    def _offload_families(self, offload: Mapping[str, Any]) -> Iterable[Metric]:
        """The KV tiers: blocks held a tier, blocks and bytes moved each way, corrupt disk files."""
        if not offload.get("enabled"):
            return
        yield self._by_label(GaugeMetricFamily, "kv_offload_blocks", "Cached KV blocks held in a lower tier.",
                             "tier", {tier: snap["blocks"] for tier, snap in offload["tiers"].items()})
        yield self._by_label(CounterMetricFamily, "kv_offload_bytes", "KV bytes copied between device and host.",
                             "direction", {"to_host": offload["bytes_to_host"],
                                           "to_device": offload["bytes_to_device"]})
        yield self._counter("kv_offload_saved_blocks", "Evicted cached blocks copied to the host tier.",
                            offload["saved_blocks"])
        yield self._counter("kv_offload_restored_blocks", "Cached blocks copied back to the device.",
                            offload["restored_blocks"])
        yield self._counter("kv_offload_disk_restored_blocks", "Of those, read from the disk tier.",
                            offload["disk_restored_blocks"])
        yield self._by_label(CounterMetricFamily, "kv_offload_swaps",
                             "Preempted sequences swapped to host and back.", "direction",
                             {"out": offload["swapped_out"], "in": offload["swapped_in"]})
        yield self._counter("kv_offload_dropped_blocks", "Evicted cached blocks not saved (host slots busy).",
                            offload["dropped_blocks"])
        if "disk" in offload["tiers"]:
            yield self._counter("kv_offload_disk_corrupt", "Disk tier files that failed their check (recomputed).",
                                offload["tiers"]["disk"]["corrupt"])

    def _stage_families(self, stages: Mapping[str, Mapping[str, Any]]) -> Iterable[Metric]:
        labels = ["model_name", "stage"]
        items_in = CounterMetricFamily("conveyor_stage_items_in", "Messages put into the stage inbox.", labels=labels)
        items_out = CounterMetricFamily("conveyor_stage_items_out", "Items the stage produced.", labels=labels)
        depth = GaugeMetricFamily("conveyor_stage_inbox_depth", "Messages waiting in the stage inbox.", labels=labels)
        histograms = {key: HistogramMetricFamily(f"conveyor_stage_{suffix}", doc, labels=labels)
                      for key, suffix, doc in _STAGE_HISTOGRAMS}
        for stage, snap in stages.items():
            values = [self._model, stage]
            items_in.add_metric(values, snap["items_in"])
            items_out.add_metric(values, snap["items_out"])
            depth.add_metric(values, snap["inbox_depth"])
            for key, family in histograms.items():
                family.add_metric(values, cumulative_buckets(snap[key]["buckets"]), snap[key]["sum"])
        yield from (items_in, items_out, depth, *histograms.values())


class PerTokenHistogram(Collector):
    """A histogram observed for every streamed token: a bisect and two adds per observation, exported
    at scrape time (prometheus_client's Histogram takes a lock and walks every bucket per observation,
    which at batch 256 costs the event loop a measurable share of each step). Event-loop thread only."""

    def __init__(self, name: str, doc: str, model_name: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.counts = BucketCounts(buckets)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts.observe(value, times)

    def collect(self) -> Iterable[Metric]:
        snapshot = self.counts.snapshot()
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        family.add_metric([self.model_name], cumulative_buckets(snapshot["buckets"]), snapshot["sum"])
        return [family]


class ServerMetrics:
    """Owns a private CollectorRegistry (never the global one, so tests and several servers don't collide)."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)  # engine_stats is only called on scrape
        reg, m = self.registry, ["model_name"]
        self._requests = Counter("conveyor_requests", "Finished requests by finish_reason.",
                                 [*m, "finish_reason"], registry=reg)
        self._api_requests = Counter("conveyor_api_requests", "Finished requests by API face and finish_reason.",
                                     [*m, "api", "finish_reason"], registry=reg)
        self._prompt_tokens = Counter("conveyor_prompt_tokens", "Prompt tokens of finished requests.",
                                      m, registry=reg).labels(model_name)
        self._generation_tokens = Counter("conveyor_generation_tokens", "Generated tokens of finished requests.",
                                          m, registry=reg).labels(model_name)
        self._ttft = self._histogram("time_to_first_token_seconds",
                                     "Arrival to first generated token, queueing and prefill included.")
        self._itl = PerTokenHistogram("conveyor_inter_token_latency_seconds",
                                      "Time between consecutive generated tokens.", model_name, REQUEST_LATENCY_BUCKETS)
        reg.register(self._itl)
        self._e2e = self._histogram("e2e_request_latency_seconds", "Arrival to the last byte of the response.")
        self._rejections = Counter("conveyor_admission_rejections", "Requests refused with 503 at admission.",
                                   [*m, "reason"], registry=reg)
        for reason in FINISH_REASONS:  # pre-create so rate() sees 0 before the first event
            self._requests.labels(model_name, reason)
        for reason in ADMISSION_REASONS:
            self._rejections.labels(model_name, reason)
        reg.register(EngineStatsCollector(engine_stats, model_name))

    def _histogram(self, name: str, doc: str) -> Any:
        return Histogram(f"conveyor_{name}", doc, ["model_name"], registry=self.registry,
                         buckets=REQUEST_LATENCY_BUCKETS).labels(self.model_name)

    def request_finished(self, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                         ttft_s: float | None, e2e_s: float, api: str = "chat_completions") -> None:
        """One call per finished request (per choice set, not per choice). ttft_s None: no token was produced.
        `api`: the face that served it (chat_completions, completions, responses, messages)."""
        self._requests.labels(self.model_name, _label(finish_reason)).inc()
        self._api_requests.labels(self.model_name, api, _label(finish_reason)).inc()
        self._prompt_tokens.inc(max(0, prompt_tokens))
        self._generation_tokens.inc(max(0, generation_tokens))
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        self._e2e.observe(e2e_s)

    def inter_token_latency(self, seconds: float, tokens: int = 1) -> None:
        """The gap before a streamed delta that carries `tokens` new tokens.

        Records `tokens` observations of seconds/tokens, so the histogram counts token gaps (not deltas)
        and its mean is the per-token latency even when a slow reader got several tokens merged.
        """
        if tokens > 0:
            self._itl.counts.observe(seconds / tokens, tokens)  # per streamed delta: straight to the counts

    def admission_rejected(self, reason: str) -> None:
        """A 503 from admission limits or draining; unknown reasons count as "other" (see admission_reason)."""
        label = _label(reason)
        self._rejections.labels(self.model_name, label if label in ADMISSION_REASONS else "other").inc()

    def render(self) -> tuple[bytes, str]:
        """(body, content_type) for GET /metrics.

        The content type carries a charset, which aiohttp's `content_type=` argument rejects: send it
        as `web.Response(body=body, headers={"Content-Type": content_type})`.
        """
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
