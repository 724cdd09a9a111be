"""`conveyor top` draws the dashboard document as text: a pure function of /dashboard/data, checked without a
terminal, and ``--once`` against a live server is in tests/web/test_dashboard.py."""
from __future__ import annotations

import argparse

import pytest

from cli.top import SPARKS, add_top_parser, positive_seconds, render_frame, sparkline
from pipeline.live_stats import LiveStats
from pipeline.live_view import live_payload
from tests.live_history import INFO, STAGES, filled

HYBRID_INFO = {**INFO, "seats_total": 64, "state_slots_total": 64, "snapshots_total": 66, "prefix_caching": True,
               "speculation": "mtp", "model": "qwen3.5"}


def frame(info: dict, width: int = 100) -> list[str]:
    live, _ = filled(90)
    payload = live_payload(live, info)
    return render_frame(payload, payload["series"]["tokens_per_s"], width, "http://host:8000")


def test_a_frame_shows_the_figures_and_every_stage_within_the_width() -> None:
    lines = frame({**INFO, "seats_total": 64, "prefix_caching": True, "speculation": None, "model": "smol"})
    assert all(len(line) <= 100 for line in lines)
    text = "\n".join(lines)
    assert lines[0].startswith("Conveyor top · smol · http://host:8000")
    assert "tokens/s 50.0" in text and "running 5" in text and "seats 5/64" in text  # the newest reading
    assert "KV [########............] 40/100 (40.0%)" in text
    assert "prefix-cache hits 25.0%" in text and "drafts accepted off" in text
    assert "state slots" not in text and "snapshots" not in text  # a dense model has neither
    header = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    rows = lines[header + 1:header + 1 + len(STAGES)]
    assert [row.split()[0] for row in rows] == list(STAGES)
    decode = rows[STAGES.index("decode")].split()
    assert decode[2:4] == ["10.0", "9.0"]  # in/s, out/s
    assert 2.5 < float(decode[4]) <= 5.0 and 100 < float(decode[5]) <= 250  # queue wait p50, p99 (ms)


def test_hybrid_and_speculative_servers_show_their_slots_snapshots_and_acceptance() -> None:
    text = "\n".join(frame(HYBRID_INFO))
    assert "state slots 0/64" in text and "snapshots 0/66" in text
    assert "drafts accepted 75.0% (mtp)" in text


def test_a_narrow_terminal_cuts_lines_and_the_sparkline_fits() -> None:
    lines = frame(HYBRID_INFO, width=40)
    assert all(len(line) <= 40 for line in lines)
    spark = next(line for line in lines if line.startswith("tokens/s ") and "max" in line)
    assert len(spark) <= 40


def test_a_server_without_samples_yet_says_so() -> None:
    payload = live_payload(LiveStats(), {**INFO, "model": "smol"})
    assert render_frame(payload, [], 80)[1] == "no samples yet: the server has just started"


def test_the_sparkline_scales_to_its_maximum_and_leaves_gaps() -> None:
    assert sparkline([0.0, 5.0, 10.0, None, 10.0], 5) == SPARKS[1] + SPARKS[4] + SPARKS[8] + " " + SPARKS[8]
    assert sparkline([1.0, 2.0, 3.0], 2) == SPARKS[5] + SPARKS[8]  # the last values that fit
    assert sparkline([0.0, 0.0], 2) == SPARKS[1] * 2
    assert sparkline([], 10) == ""


def test_the_interval_flag_refuses_nonsense() -> None:
    parser = argparse.ArgumentParser()
    add_top_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["top", "--interval", "2.5"]).interval == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_seconds(bad)
