"""GET /debug/trace against a live server: a Chrome trace-event file with every stage's spans, the device's steps and
a streamed request's phases; bad windows are 400s in OpenAI's error shape, and the route is behind --api-key."""
from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

import orjson
import pytest

from pipeline.trace_export import DEVICE_PID, REQUESTS_PID, STAGES_PID
from tests.web.server_utils import LiveServer, wait_for
from web.app import ServerSettings

KEY = "trace-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
STAGES = ("intake", "prefill", "decode", "verify", "detokenize", "stream")
# a prompt that repeats, so the n-gram drafter has suffixes to look up
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "one two three one two three one two three"}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    settings = ServerSettings(served_model_names=["tiny"], api_key=KEY)
    with LiveServer(tiny_model_dir, settings, speculative_method="ngram", num_speculative_tokens=2) as live:
        yield live


def get(server: LiveServer, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(server.url + path, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def stream_chat(server: LiveServer) -> list[dict]:
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=orjson.dumps(CHAT),
                                     headers={**AUTH, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read()
    return [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


def trace_during(server: LiveServer, seconds: float, work: Any) -> tuple[dict, Any]:
    """A trace of ``seconds`` with ``work()`` run inside its window."""
    got: dict[str, Any] = {}
    recording = threading.Thread(target=lambda: got.update(reply=get(server, f"/debug/trace?seconds={seconds}",
                                                                     AUTH)))
    recording.start()
    wait_for(lambda: server.engine.trace.recording)
    result = work()
    recording.join(60)
    status, body = got["reply"]
    assert status == 200, body
    return orjson.loads(body), result


def assert_valid_chrome_trace(trace: dict) -> list[dict]:
    """Every event has what Chrome's format needs; the X spans of each track nest or follow one another."""
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    tracks: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for event in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= event.keys(), event
        assert event["ph"] in ("X", "M"), event
        if event["ph"] == "X":
            assert event["dur"] >= 0, event
            tracks[(event["pid"], event["tid"])].append(event)
    for spans in tracks.values():
        open_ends: list[float] = []
        for span in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= span["ts"] + 1e-3:  # (float sums of ts and dur)
                open_ends.pop()
            end = span["ts"] + span["dur"]
            assert not open_ends or end <= open_ends[-1] + 1e-3, f"spans overlap on one track: {span}"
            open_ends.append(end)
    return [e for e in events if e["ph"] == "X"]


def test_a_streamed_request_shows_in_every_stage_on_the_device_and_on_its_own_track(server):
    trace, chunks = trace_during(server, 1.5, lambda: stream_chat(server))
    spans = assert_valid_chrome_trace(trace)
    stage_spans = {e["name"] for e in spans if e["pid"] == STAGES_PID and e["cat"] == "stage"}
    assert set(STAGES) <= stage_spans
    thread_names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert set(STAGES) <= thread_names and {"device thread", "device"} <= thread_names

    steps = [e for e in spans if e["pid"] == DEVICE_PID and e["name"] == "step"]
    assert any(s["args"].get("prompt_tokens", 0) > 0 for s in steps)  # the prompt's step
    assert any(s["args"].get("decode_rows", 0) > 0 for s in steps)  # its decode steps
    assert all({"host_ms", "device_ms", "decode_rows", "verify_rows", "prompt_tokens"} <= s["args"].keys()
               for s in steps)
    assert any(e["name"] == "step launch" for e in spans if e["pid"] == DEVICE_PID)
    assert trace["otherData"]["device_busy_ms"] > 0 and trace["otherData"]["steps"] >= len(steps)

    request_id, usage = chunks[0]["id"], chunks[-1]["usage"]
    (whole,) = [e for e in spans if e["pid"] == REQUESTS_PID and e["name"] == "request"
                and e["args"]["request_id"] == request_id]
    assert whole["args"]["completed"] and whole["args"]["prompt_tokens"] == usage["prompt_tokens"]
    phases = sorted((e for e in spans if e["pid"] == REQUESTS_PID and e["tid"] == whole["tid"] and e is not whole
                     and whole["ts"] <= e["ts"] <= whole["ts"] + whole["dur"]), key=lambda e: e["ts"])
    assert [p["name"] for p in phases] == ["intake queue", "intake", "prefill queue", "prefill", "decode queue",
                                           "decode"]
    assert phases[-1]["ts"] + phases[-1]["dur"] == pytest.approx(whole["ts"] + whole["dur"], abs=1e-3)


def test_the_window_is_a_number_of_seconds_within_bounds(server):
    for bad in ("0", "61", "abc", "nan", "inf", "-1"):
        status, body = get(server, f"/debug/trace?seconds={bad}", AUTH)
        error = orjson.loads(body)["error"]
        assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == "seconds", body
        assert "seconds must be a number from 0.1 to 60" in error["message"]
    assert not server.engine.trace.recording  # a refused window records nothing


def test_the_route_is_behind_the_api_key(server):
    status, body = get(server, "/debug/trace?seconds=0.1")
    assert status == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"
    assert get(server, "/debug/trace?seconds=0.1", {"x-api-key": KEY})[0] == 200


def test_nothing_is_recorded_while_no_window_is_open(server):
    recorder = server.engine.trace
    before = list(recorder.events)
    stream_chat(server)
    server.wait_idle()
    assert not recorder.recording and list(recorder.events) == before
