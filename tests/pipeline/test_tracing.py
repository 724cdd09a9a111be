"""pipeline/tracing.py, trace_export.py, trace_files.py: the ring is bounded, hooks do nothing while off, the layout
keeps Chrome's one-track rule, and --trace-dir writes rotating files (at most the newest N)."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from pipeline.stage import Stage
from pipeline.trace_export import DEVICE_PID, DEVICE_TID, REQUESTS_PID, STAGES_PID, chrome_trace, nesting_lanes
from pipeline.trace_files import FILE_PREFIX, TraceFiles, prepare_trace_dir
from pipeline.tracing import PREEMPT, REQUEST_END, SERVICE, STEP_PLAN, STEP_RUN, WAIT, TraceRecorder
from tests.conftest import run_async
from tests.engine_utils import collect, config_for


class NeverCalled(TraceRecorder):
    """A recorder whose hooks fail if anything calls them: while it is off, nothing may."""

    def waited(self, *args: object) -> None:
        raise AssertionError("a hook ran while tracing was off")

    served = preempted = request_ended = step_planned = device_work = device_mark = waited


def test_a_stage_calls_no_hook_while_off_and_records_its_waits_and_service_while_on():
    async def main() -> list[tuple]:
        stage = Stage(inbox_size=8)
        stage.name = "detokenize"
        stage.trace = NeverCalled(capacity=1024)
        await stage.put("off")
        await stage.receive()
        stage.record(0.0, 1, 1)
        stage.trace = recorder = TraceRecorder(capacity=1024)
        recorder.begin_session()
        await stage.put("on")
        await stage.put("ready")
        await stage.receive()
        stage.receive_ready()
        stage.record(1.5, 2, 3)
        return list(recorder.events)

    events = asyncio.run(main())
    assert [e[0] for e in events] == [WAIT, WAIT, SERVICE]
    assert all(e[3] == "detokenize" and e[4] is None for e in events[:2])  # a plain message names no request
    assert events[2][2:] == (1.5, "detokenize", 2, 3)


def test_the_ring_keeps_the_newest_events_up_to_its_capacity():
    recorder = TraceRecorder(capacity=1024)
    for i in range(5000):
        recorder.served("stream", float(i), float(i) + 0.5, 1, 1)
    assert len(recorder.events) == 1024 and recorder.dropped_since(0.0) and not recorder.dropped_since(4000.0)
    assert recorder.events[0][2] == 5000 - 1024
    assert [e[2] for e in recorder.window(4999.0, 5000.0)] == [4999.0]
    assert recorder.recorded_since(5000 - 513, 512) and not recorder.recorded_since(5000 - 511, 512)


def test_sessions_and_continuous_recording_switch_it_on_and_off_together():
    recorder = TraceRecorder(capacity=1024)
    recorder.begin_session()
    recorder.begin_session()
    recorder.end_session()
    assert recorder.recording
    recorder.set_continuous(True)
    recorder.end_session()
    assert recorder.recording
    recorder.set_continuous(False)
    assert not recorder.recording


def test_overlapping_spans_of_one_stage_go_to_extra_tracks_nested_ones_stay():
    spans = [(0.0, 4.0, "a", "", {}), (1.0, 2.0, "b", "", {}), (3.0, 6.0, "c", "", {}), (6.0, 7.0, "d", "", {})]
    assert nesting_lanes(spans) == [0, 0, 1, 0]


def layout(events: list[tuple], until: float = 10.0) -> list[dict]:
    trace = chrome_trace(events, origin=0.0, origin_unix=0.0, since=0.0, until=until,
                         stages=("prefill", "decode"), resolve=lambda mark: mark)
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_decode_steps_that_overlap_running_ahead_are_drawn_on_two_decode_tracks():
    spans = layout([(SERVICE, 2.0, 0.0, "decode", 4, 4), (SERVICE, 3.0, 1.0, "decode", 4, 4)])
    decode = [e for e in spans if e["pid"] == STAGES_PID and e["name"] == "decode"]
    assert sorted(e["tid"] for e in decode) == [2000, 2001]


def test_device_steps_carry_their_makeup_and_the_gaps_between_them_are_idle_spans():
    spans = layout([(STEP_PLAN, 0.5, 1, "decode", 8, 2, 1, 100, 118), (STEP_RUN, 1.0, 0.5, 1, 0.6, 1.2),
                    (STEP_RUN, 1.6, 1.1, 2, 1.5, 1.9)])
    device = sorted((e for e in spans if e["pid"] == DEVICE_PID and e["tid"] == DEVICE_TID), key=lambda e: e["ts"])
    assert [e["name"] for e in device] == ["step", "device idle", "step"]
    assert device[0]["args"] == {"step": 1, "host_ms": 500.0, "lane": "decode", "decode_rows": 8, "verify_rows": 2,
                                 "prompt_chunks": 1, "prompt_tokens": 100, "tokens": 118, "device_ms": 600.0}
    assert device[1]["ts"] == 1.2e6 and device[1]["dur"] == pytest.approx(0.3e6)
    assert "lane" not in device[2]["args"]  # its plan was recorded before the window


def test_a_preempted_request_goes_back_to_prefill_on_its_track_and_its_samples_get_tracks_of_their_own():
    spans = layout([(WAIT, 1.0, 0.5, "prefill", "r"), (WAIT, 3.0, 2.0, "decode", "r"), (PREEMPT, 4.0, "r"),
                    (WAIT, 6.0, 5.0, "decode", "r"), (WAIT, 6.5, 6.0, "decode", "r#1"),
                    (REQUEST_END, 8.0, "r", 0.2, 10, 4, True)])
    tracks: dict[int, list[dict]] = {}
    for e in spans:
        if e["pid"] == REQUESTS_PID:
            tracks.setdefault(e["tid"], []).append(e)
    first, second = (sorted(track, key=lambda e: (e["ts"], -e["dur"])) for track in tracks.values())
    assert [(e["name"], e["ts"] / 1e6) for e in first] == [
        ("request", 0.2), ("prefill queue", 0.5), ("prefill", 1.0), ("decode queue", 2.0), ("decode", 3.0),
        ("prefill", 4.0), ("decode queue", 5.0), ("decode", 6.0)]
    assert first[0]["args"] == {"request_id": "r", "prompt_tokens": 10, "cached_prompt_tokens": 4, "completed": True}
    assert first[5]["args"] == {"preempted": True}
    assert [e["name"] for e in second] == ["request", "decode queue", "decode"] and second[0]["args"]["sample"] == 1


def test_a_request_still_running_when_the_window_closes_is_drawn_up_to_its_end():
    (request, phase) = [e for e in layout([(WAIT, 1.0, 0.5, "prefill", "r")], until=2.0) if e["pid"] == REQUESTS_PID
                        ][:2]
    assert request["args"]["open"] and request["ts"] + request["dur"] == 2.0e6


def test_the_trace_directory_keeps_only_its_newest_files(tmp_path):
    now = [0.0]
    recorder = TraceRecorder(capacity=1024)
    recorder.origin = 0.0  # timestamps on the test's clock
    files = TraceFiles(recorder, str(tmp_path / "traces"), 60.0, 2, ("stream",), clock=lambda: now[0])
    (tmp_path / "traces" / "notes.txt").write_text("not a trace")

    async def main() -> list:
        written = []
        for i in range(4):
            now[0] = i + 1.0
            recorder.served("stream", i + 0.25, i + 0.5, 1, 1)
            written.append(await files.write())
        now[0] = 10.0
        written.append(await files.write())  # nothing new: no file
        return written

    written = asyncio.run(main())
    assert written[-1] is None
    kept = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert kept == sorted([written[2].name, written[3].name, "notes.txt"])
    spans = [e for e in orjson.loads(written[3].read_bytes())["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"]) for e in spans] == [("stream", 3.25e6)]  # only what the window since the last held


def test_a_trace_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--trace-dir"):
        prepare_trace_dir(str(tmp_path / "file"))


def test_an_engine_with_a_trace_dir_writes_its_requests_to_a_file(tiny_model_dir, tmp_path):
    from pipeline.engine import Engine
    from pipeline.request import SamplingParams

    async def main() -> None:
        engine = await Engine.create(config_for(tiny_model_dir, trace_dir=str(tmp_path)))
        try:
            await collect(engine, prompt="hello there", params=SamplingParams(max_tokens=4, ignore_eos=True),
                          request_id="traced")
        finally:
            await engine.shutdown()  # writes the last file

    run_async(main())
    (path,) = tmp_path.iterdir()
    assert path.name.startswith(FILE_PREFIX)
    spans = [e for e in orjson.loads(path.read_bytes())["traceEvents"] if e["ph"] == "X"]
    assert any(e["name"] == "request" and e["args"]["request_id"] == "traced" and e["args"]["completed"]
               for e in spans)
    assert {"intake", "prefill", "decode", "detokenize", "stream", "step"} <= {e["name"] for e in spans}


@pytest.mark.gpu
def test_the_cuda_clock_places_a_steps_device_span_on_the_host_clock():
    import time

    import torch

    from pipeline.tracing import CudaClock

    clock = CudaClock(torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    before = time.monotonic()
    start = clock.mark()
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    end = clock.mark()
    torch.cuda.synchronize()
    after = time.monotonic()
    began, ended = CudaClock.resolve(start), CudaClock.resolve(end)
    assert before <= began < ended <= after + 1e-3  # (the anchor's host time is read just after it is reached)


def test_the_serve_flags_reach_the_engine_config_and_the_server_settings(tmp_path, capsys):
    import argparse

    from cli.main import add_serve_parser, engine_config, main, server_settings, set_trace_options

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--trace-dir", str(tmp_path), "--trace-file-seconds", "5", "--trace-max-files",
                              "3", "--trace-buffer-events", "4096", "--otlp-traces-endpoint", "http://collector:4317"])
    config = engine_config(args)
    set_trace_options(config, args)
    assert (config.trace_dir, config.trace_file_seconds, config.trace_max_files, config.trace_buffer_events) == (
        str(tmp_path), 5.0, 3, 4096)
    assert server_settings(args).otlp_traces_endpoint == "http://collector:4317"
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--trace-max-files", "0"])
    assert exited.value.code == 2 and "--trace-max-files: must be at least 1, got 0" in capsys.readouterr().err
