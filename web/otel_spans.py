"""--otlp-traces-endpoint URL: one OpenTelemetry span per request, exported over OTLP, as vLLM's flag of that name does.

The span (``llm_request``, kind SERVER) runs from the request's arrival at the HTTP layer to its end and carries the
GenAI semantic conventions' attributes vLLM sets (``gen_ai.request.*``, ``gen_ai.usage.*``, ``gen_ai.latency.*``:
queue time to the first prompt chunk, prefill to the first token, decode to the last), the cached prompt tokens
(``gen_ai.usage.cache_read.input_tokens``), the finish reasons, and the request's speculation counts
(``conveyor.speculation.*``). A ``traceparent`` header makes it a child of the caller's span. The protocol is OTLP/gRPC
unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says http/protobuf; the SDK's other OTEL_* variables apply (service name,
headers, TLS).

The SDK is imported only here, and this module only where the flag is given: without it nothing of OpenTelemetry
loads. Spans leave through a batch processor on the SDK's own thread, so a slow collector never holds a request.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

OTEL_PACKAGES = "opentelemetry-sdk opentelemetry-exporter-otlp"
SPAN_NAME = "llm_request"
TRACER_NAME = "conveyor"


class TelemetryUnavailable(RuntimeError):
    """--otlp-traces-endpoint without the OpenTelemetry SDK, or with a protocol it does not know."""


def monotonic_to_unix_ns(t: float) -> int:
    """A time.monotonic() stamp on the wall clock the spans use."""
    return time.time_ns() - int((time.monotonic() - t) * 1e9)


class RequestSpans:
    """Makes and exports the spans. ``exporter``: any SDK span exporter (the tests pass an in-memory one, which
    with ``batch=False`` holds each span as soon as its request ends)."""

    def __init__(self, exporter: Any, batch: bool = True) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "conveyor"})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer(TRACER_NAME)
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)

    @classmethod
    def for_endpoint(cls, endpoint: str) -> RequestSpans:
        """Spans to an OTLP collector at ``endpoint``; TelemetryUnavailable names what is missing."""
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            elif protocol == "http/protobuf":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore
            else:
                raise TelemetryUnavailable(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: the traces exporter "
                                           "speaks grpc or http/protobuf")
            import opentelemetry.sdk.trace  # noqa: F401  (the SDK, apart from the exporter)
        except ImportError as exc:
            raise TelemetryUnavailable(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter "
                                       f"({exc.name or exc} is missing): pip install {OTEL_PACKAGES}") from None
        return cls(OTLPSpanExporter(endpoint=endpoint))

    def request_ended(self, request_id: str, model: str, api: str, tracker: Any,
                      headers: Mapping[str, str]) -> None:
        """The span of a request that ended now. ``tracker``: its web/generation.py Tracker (arrival, first and last
        token, usage, finish reasons, and the engine's admitted Request with its own timings and counts)."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=self._server,
                                      start_time=monotonic_to_unix_ns(tracker.arrival))
        span.set_attributes(request_attributes(request_id, model, api, tracker, time.monotonic()))
        if any(c.finish_reason is not None and c.finish_reason.value == "error" for c in tracker.choices.values()):
            span.set_status(self._error)
        span.end()

    def shutdown(self) -> None:
        """Export what is queued, then stop the exporter."""
        self.provider.shutdown()


def request_attributes(request_id: str, model: str, api: str, tracker: Any, ended: float) -> dict[str, Any]:
    """The span's attributes (vLLM's names where it has one; seconds for latencies)."""
    attributes: dict[str, Any] = {
        "gen_ai.request.id": request_id,
        "gen_ai.response.model": model,
        "gen_ai.usage.prompt_tokens": tracker.prompt_tokens,
        "gen_ai.usage.completion_tokens": tracker.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": tracker.cached_tokens,
        "gen_ai.usage.num_sequences": len(tracker.choices),
        "gen_ai.response.finish_reasons": [c.finish_reason.value for c in tracker.choices.values()
                                           if c.finish_reason is not None],
        "gen_ai.latency.e2e": ended - tracker.arrival,
        "conveyor.api": api,
    }
    first, last = tracker.first_token, tracker.last_delta
    if first is not None:
        attributes["gen_ai.latency.time_to_first_token"] = first - tracker.arrival
        if last is not None:
            attributes["gen_ai.latency.time_in_model_decode"] = last - first
    request = tracker.admitted
    if request is None:  # refused or gone before admission: what the HTTP layer saw is all there is
        return attributes
    params = request.params
    for name, value in (("max_tokens", params.max_tokens), ("temperature", params.temperature),
                        ("top_p", params.top_p), ("n", params.n)):
        if value is not None:
            attributes[f"gen_ai.request.{name}"] = value
    scheduled = request.scheduled_time
    if scheduled is not None:
        attributes["gen_ai.latency.time_in_queue"] = scheduled - tracker.arrival
        if first is not None:
            attributes["gen_ai.latency.time_in_model_prefill"] = first - scheduled
            attributes["gen_ai.latency.time_in_model_inference"] = (last or first) - scheduled
    if request.drafted_tokens:
        attributes["conveyor.speculation.draft_tokens"] = request.drafted_tokens
        attributes["conveyor.speculation.accepted_tokens"] = request.accepted_tokens
        attributes["conveyor.speculation.acceptance_rate"] = request.accepted_tokens / request.drafted_tokens
    return attributes


def request_spans_for(endpoint: str | None) -> RequestSpans | None:
    """What serve() hands the server for --otlp-traces-endpoint (None without the flag: nothing is imported)."""
    return RequestSpans.for_endpoint(endpoint) if endpoint else None
