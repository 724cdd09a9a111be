"""--otlp-traces-endpoint: one OpenTelemetry span per request (captured here by the SDK's in-memory exporter) with the
request's usage, timings, finish reasons and speculation counts; without the flag serving imports nothing of
OpenTelemetry, and a missing SDK with the flag stops the server at startup with one line."""
from __future__ import annotations

import asyncio
import ast
import sys
from pathlib import Path
import urllib.request

import orjson
import pytest

from tests.engine_utils import config_for
from tests.web.server_utils import LiveServer
from web.app import ServerSettings

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from web.otel_spans import OTEL_PACKAGES, RequestSpans  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    exporter = InMemorySpanExporter()
    with LiveServer(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=2) as live:
        live.state.request_spans = RequestSpans(exporter, batch=False)
        yield live, exporter


def post(server: LiveServer, path: str, body: dict, headers: dict[str, str] | None = None) -> bytes:
    request = urllib.request.Request(server.url + path, data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


def span_of(exporter: InMemorySpanExporter, request_id: str):
    (span,) = [s for s in exporter.get_finished_spans() if s.attributes["gen_ai.request.id"] == request_id]
    return span


def test_a_streamed_chat_request_gets_a_server_span_with_its_usage_timings_and_the_callers_parent(served):
    server, exporter = served
    raw = post(server, "/v1/chat/completions",
               {"model": "tiny", "messages": [{"role": "user", "content": "a b c a b c a b c"}], "max_tokens": 9,
                "temperature": 0.5, "top_p": 0.9, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}},
               {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    chunks = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    span = span_of(exporter, chunks[0]["id"])
    usage, attributes = chunks[-1]["usage"], span.attributes
    assert span.name == "llm_request" and span.kind.name == "SERVER"
    assert format(span.context.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == PARENT_ID
    assert attributes["gen_ai.response.model"] == "tiny" and attributes["conveyor.api"] == "chat_completions"
    assert attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 9
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == ("length",)
    assert (attributes["gen_ai.request.max_tokens"], attributes["gen_ai.request.temperature"],
            attributes["gen_ai.request.top_p"], attributes["gen_ai.request.n"]) == (9, 0.5, 0.9, 1)
    queue, prefill = attributes["gen_ai.latency.time_in_queue"], attributes["gen_ai.latency.time_in_model_prefill"]
    ttft, decode = attributes["gen_ai.latency.time_to_first_token"], attributes["gen_ai.latency.time_in_model_decode"]
    assert queue > 0 and prefill > 0 and decode > 0
    assert queue + prefill == pytest.approx(ttft)
    assert attributes["gen_ai.latency.time_in_model_inference"] == pytest.approx(prefill + decode)
    assert ttft + decode <= attributes["gen_ai.latency.e2e"]
    assert span.end_time - span.start_time == pytest.approx(attributes["gen_ai.latency.e2e"] * 1e9, rel=0.05)


def test_a_repeated_prompt_counts_its_cached_tokens_and_the_drafts_add_up_to_the_engines(served):
    server, exporter = served
    drafted_before = server.engine.stats()["speculation"]["drafted_tokens"]
    body = {"model": "tiny", "prompt": "the cat sat on the mat " * 4, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    answers = [orjson.loads(post(server, "/v1/completions", body)) for _ in range(2)]
    spans = [span_of(exporter, answer["id"]) for answer in answers]
    cached = [s.attributes["gen_ai.usage.cache_read.input_tokens"] for s in spans]
    assert cached == [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] and cached[1] > 0
    assert all(s.attributes["conveyor.api"] == "completions" for s in spans)
    drafted = sum(s.attributes.get("conveyor.speculation.draft_tokens", 0) for s in spans)
    assert drafted == server.engine.stats()["speculation"]["drafted_tokens"] - drafted_before
    for span in spans:
        if "conveyor.speculation.draft_tokens" in span.attributes:
            accepted = span.attributes["conveyor.speculation.accepted_tokens"]
            assert span.attributes["conveyor.speculation.acceptance_rate"] == pytest.approx(
                accepted / span.attributes["conveyor.speculation.draft_tokens"])


def test_without_the_flag_a_served_request_imports_nothing_of_opentelemetry(served, monkeypatch):
    from web.otel_spans import request_spans_for

    server, _ = served
    monkeypatch.setattr(server.state, "request_spans", request_spans_for(None))  # what serve() sets without the flag
    for module in [m for m in sys.modules if m.split(".")[0] == "opentelemetry"]:
        monkeypatch.delitem(sys.modules, module)  # (put back after the test)
    post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 3, "stream": True})
    assert server.state.request_spans is None
    assert not [m for m in sys.modules if m.split(".")[0] == "opentelemetry"]


def opentelemetry_imports() -> list[tuple[str, bool]]:
    """(file, inside a function) of every import of opentelemetry in the server's packages, read from the source."""
    found = []
    for package in ("cli", "web", "pipeline"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            deferred = {id(n) for f in functions for n in ast.walk(f)}
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(name.split(".")[0] == "opentelemetry" for name in names):
                    found.append((str(path.relative_to(ROOT)), id(node) in deferred))
    return found


def test_only_the_span_module_imports_opentelemetry_and_only_when_it_makes_spans():
    found = opentelemetry_imports()
    assert found and all(path == "web/otel_spans.py" and deferred for path, deferred in found), found


def test_a_missing_sdk_with_the_flag_stops_the_server_at_startup_with_one_line(monkeypatch, capsys, tiny_model_dir):
    from web.serve import run_server

    for module in ("opentelemetry.sdk", "opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc",
                   "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"):
        monkeypatch.setitem(sys.modules, module, None)  # an import of it fails as if it were not installed
    settings = ServerSettings(["tiny"], otlp_traces_endpoint="http://127.0.0.1:4317")
    said: list[str] = []
    code = asyncio.run(run_server(config_for(tiny_model_dir), settings, "127.0.0.1", 0, 1.0, say=said.append))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and not said  # before it listens or loads anything
    assert lines == [f"conveyor: error: --otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter "
                     f"(opentelemetry.exporter.otlp.proto.grpc.trace_exporter is missing): pip install {OTEL_PACKAGES}"]
