"""GET /dashboard and /dashboard/data on a live server: the key guards every dashboard route (header, ?key= or the
cookie it sets, and that cookie opens nothing else), the data stay bounded and well formed under 64 concurrent
streams, and headless Chromium renders the page's plots under load with no console errors."""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import aiohttp
import orjson
import pytest

from cli.top import top_main
from pipeline.live_view import MAX_POINTS, RECENT_STEPS, SERIES, STAGE_SERIES
from tests.web.headless_chromium import HeadlessChromium, chromium_available
from tests.web.server_utils import LiveServer, wait_for
from web.app import ServerSettings
from web.dashboard import KEY_COOKIE, key_digest

KEY = "dashboard-test-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
STAGES = ["intake", "prefill", "decode", "verify", "detokenize", "stream"]
STREAMS = 64
TOKENS = 48


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    settings = ServerSettings(served_model_names=["tiny"], api_key=KEY)
    with LiveServer(tiny_model_dir, settings, max_num_seqs=STREAMS, num_kv_blocks=2048) as live:
        yield live


async def stream_one(session: aiohttp.ClientSession, url: str, index: int) -> int:
    body = {"model": "tiny", "stream": True, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": f"Count the boxes on belt {index}."}]}
    async with session.post(url + "/v1/chat/completions", json=body, headers=BEARER) as response:
        assert response.status == 200
        return sum([1 async for line in response.content if line.startswith(b"data: {")])


async def keep_streaming(url: str, concurrency: int, stop: asyncio.Event) -> None:
    async def worker(session: aiohttp.ClientSession, index: int) -> None:
        while not stop.is_set():
            await stream_one(session, url, index)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session, index) for index in range(concurrency)))


async def get(session: aiohttp.ClientSession, url: str, **kwargs) -> tuple[int, dict, bytes]:
    async with session.get(url, allow_redirects=False, **kwargs) as response:
        return response.status, dict(response.headers), await response.read()


def check_shape(payload: dict) -> None:
    """Every figure the page and `top` read is there, each column as long as the times, within the bounds."""
    assert payload["version"] == 1 and payload["info"]["stages"] == STAGES
    assert payload["info"]["kv_blocks_total"] > 0 and payload["info"]["seats_total"] == STREAMS
    series = payload["series"]
    assert set(series) == {*SERIES, "stages"} and len(series["t"]) <= MAX_POINTS
    assert all(len(series[key]) == len(series["t"]) for key in SERIES)
    assert set(series["stages"]) == set(STAGES)
    assert all(set(columns) == set(STAGE_SERIES) and all(len(c) == len(series["t"]) for c in columns.values())
               for columns in series["stages"].values())
    assert all(0 <= running <= STREAMS for running in series["running"])
    assert all(rows is None or 0 <= rows <= STREAMS for rows in series["decode_rows"])
    steps = payload["steps"]
    assert len(steps["t"]) <= RECENT_STEPS and all(len(c) == len(steps["t"]) for c in steps.values())
    assert all(0 <= rows <= STREAMS for rows in steps["decode_rows"]) and all(ms >= 0 for ms in steps["ms"])
    now = payload["now"]
    if now is not None:
        assert set(now["stages"]) == set(STAGES)
        assert 0 <= now["running"] <= STREAMS and 0 <= now["kv_blocks_used"] <= payload["info"]["kv_blocks_total"]
        for stage in now["stages"].values():
            for figure in ("queue_wait_ms", "service_ms"):
                p50, p99 = stage[figure]["p50"], stage[figure]["p99"]
                assert (p50 is None) == (p99 is None) and (p50 is None or 0 <= p50 <= p99)


def test_every_dashboard_route_needs_the_key_and_the_cookie_opens_only_them(server):
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            for path in ("/dashboard", "/dashboard/data", "/dashboard/static/dashboard.js"):
                status, _, body = await get(session, server.url + path)
                assert status == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"
                assert (await get(session, server.url + path, headers={"Authorization": "Bearer wrong"}))[0] == 401
                assert (await get(session, server.url + path + "?key=wrong"))[0] == 401
            assert (await get(session, server.url + "/dashboard/data", headers=BEARER))[0] == 200
            assert (await get(session, server.url + "/dashboard/data", headers={"x-api-key": KEY}))[0] == 200
            status, headers, _ = await get(session, server.url + f"/dashboard?key={KEY}")
            assert status == 303 and headers["Location"] == "dashboard"
            cookie = headers["Set-Cookie"]
            assert f"{KEY_COOKIE}={key_digest(KEY)}" in cookie and KEY not in cookie
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
            jar = {"Cookie": f"{KEY_COOKIE}={key_digest(KEY)}"}
            status, headers, page = await get(session, server.url + "/dashboard", headers=jar)
            assert status == 200 and headers["Content-Type"].startswith("text/html")
            assert "script-src 'self'" in headers["Content-Security-Policy"] and b"dashboard.js" in page
            for name in ("dashboard.js", "uPlot.iife.min.js", "uPlot.min.css", "favicon.svg"):
                assert (await get(session, server.url + "/dashboard/static/" + name, headers=jar))[0] == 200
            assert (await get(session, server.url + "/dashboard/static/nothing.js", headers=jar))[0] == 404
            assert (await get(session, server.url + "/v1/models", headers=jar))[0] == 401  # the cookie is no API key
            assert (await get(session, server.url + "/v1/models", headers={"Cookie": f"{KEY_COOKIE}={KEY}"}))[0] == 401

    asyncio.run(main())


@pytest.mark.parametrize("query, field", [("since=-1", "since"), ("since=abc", "since"), ("window=0", "window"),
                                          ("window=1e9", "window"), ("window=soon", "window")])
def test_bad_data_parameters_are_400_naming_the_parameter(server, query, field):
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            status, _, body = await get(session, f"{server.url}/dashboard/data?{query}", headers=BEARER)
        assert status == 400
        error = orjson.loads(body)["error"]
        assert error["param"] == field and field in error["message"]

    asyncio.run(main())


def test_the_data_stay_bounded_and_consistent_under_64_concurrent_streams(server):
    async def main() -> tuple[list[dict], dict, int]:
        polls: list[dict] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            streams = asyncio.gather(*(stream_one(session, server.url, index) for index in range(STREAMS)))
            since = 0
            while not streams.done():  # poll as the page does, from the seq it has, while the streams run
                status, _, body = await get(session, f"{server.url}/dashboard/data?since={since}", headers=BEARER)
                assert status == 200 and len(body) < 256_000
                payload = orjson.loads(body)
                polls.append(payload)
                since = payload["seq"]
                await asyncio.wait([streams], timeout=0.25)
            deltas = await streams
            ended_at = since
            await asyncio.to_thread(wait_for, lambda: server.engine.live.samples[-1].seq > ended_at + 1)
            status, _, body = await get(session, f"{server.url}/dashboard/data?since=0&window=120", headers=BEARER)
            assert status == 200
        return polls, orjson.loads(body), sum(deltas)

    polls, whole, deltas = asyncio.run(main())
    assert deltas >= STREAMS * TOKENS // 2  # the streams ran (deltas merge when the client reads late)
    for payload in [*polls, whole]:
        check_shape(payload)
    # a poll from the seq it had brings only newer points
    seqs = [payload["seq"] for payload in polls]
    assert seqs == sorted(seqs)
    assert all(len(b["series"]["t"]) == b["seq"] - a["seq"] for a, b in zip(polls, polls[1:]))
    series, steps = whole["series"], whole["steps"]
    assert max(steps["decode_rows"]) > 8  # the streams were batched
    assert max(value or 0 for value in series["tokens_per_s"]) > 0
    assert max(value or 0 for value in series["steps_per_s"]) > 0
    assert whole["now"]["running"] == 0 and whole["now"]["device_steps"] >= TOKENS
    picked = server.engine.live.samples[-1].reading.picked_tokens
    assert picked >= STREAMS * TOKENS  # every stream's tokens, counted by the history


def test_top_once_prints_a_frame_of_the_server_and_refuses_without_its_key(server, capsys):
    arguments = dict(url=server.url, interval=1.0, once=True)
    assert top_main(argparse.Namespace(api_key=KEY, **arguments)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"Conveyor top · tiny · {server.url}")
    assert [line.split()[0] for line in lines if line.split() and line.split()[0] in STAGES] == STAGES
    assert top_main(argparse.Namespace(api_key=None, **arguments)) == 1
    assert "invalid or missing API key" in capsys.readouterr().err


PLOTS_WITH_DATA = """(() => {
  const d = window.conveyorDashboard;
  if (!d || d.polls < 3 || !d.plots.throughput) return false;
  const tokens = d.plots.throughput.chart.data[1].filter((v) => v > 0).length;
  const steps = d.plots["recent-steps"].chart.data[0].length;
  return tokens > 0 && steps > 0 ? { tokens, steps, plots: Object.keys(d.plots).length, failures: d.failures } : false;
})()"""
# pixels of the throughput plot's first series colour (#2f6fde): its line was drawn on the canvas
LINE_PIXELS = """(() => {
  const canvas = document.querySelector("#plot-throughput canvas");
  const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let count = 0;
  for (let i = 0; i < pixels.length; i += 4) {
    if (Math.abs(pixels[i] - 47) < 40 && Math.abs(pixels[i + 1] - 111) < 40 && Math.abs(pixels[i + 2] - 222) < 40
        && pixels[i + 3] > 128) count++;
  }
  return count;
})()"""
STAGE_BOXES = "document.querySelectorAll('#graph .stage').length"


def test_headless_chromium_renders_the_plots_under_load_with_no_console_errors(server, tmp_path: Path):
    if not chromium_available():
        pytest.skip("Chromium is not installed (/usr/bin/chromium; apt-get install -y chromium)")

    async def main() -> tuple[dict, int, int, list[str]]:
        stop = asyncio.Event()
        load = asyncio.create_task(keep_streaming(server.url, 8, stop))
        try:
            async with HeadlessChromium() as browser:
                await browser.open(f"{server.url}/dashboard?key={KEY}")  # the key once; the cookie from then on
                drawn = await browser.wait_until(PLOTS_WITH_DATA, timeout_s=60)
                pixels = await browser.evaluate(LINE_PIXELS)
                boxes = await browser.evaluate(STAGE_BOXES)
                await browser.screenshot(tmp_path / "dashboard.png")
                problems = browser.problems.all()
        finally:
            stop.set()
            await load
        return drawn, pixels, boxes, problems

    drawn, pixels, boxes, problems = asyncio.run(main())
    assert problems == []
    assert drawn["plots"] == 10 and drawn["failures"] == 0
    assert pixels > 50 and boxes == len(STAGES)
    assert (tmp_path / "dashboard.png").stat().st_size > 20_000
