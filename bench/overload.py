"""Overload run: a server with small admission limits driven past capacity by concurrent streaming clients; what it
accepts and refuses second by second, the accepted requests' TTFT and ITL, queue depths and memory, that nothing is
left held once the load stops, and a SIGTERM drain with streams in flight. The same load on a server with the default
limits shows what the limits buy. Figures for docs/deploy.md.

    .venv/bin/python bench/overload.py [--screenshot docs/deploy-overload.png] [--no-baseline]

Clients are closed loops (bench/serve.py's request shape): each sends a streaming completion, reads it to the end,
and on a 503 waits the Retry-After the server sent before trying again. Two clients ask for long outputs and never
read (a receive buffer of a few KiB): `--write-timeout` cuts them. While the load runs, headless Chromium
(tests/web/headless_chromium.py) screenshots the dashboard. Writes bench/results/overload-cpu-<commit>.json (or
--out) and prints it. Asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

from overload_outcomes import Outcome, Phase, cuts_seen, parse_metrics, per_second, summarize  # noqa: E402
from report import emit_json  # noqa: E402  (bench/ is on sys.path once the lines above ran)
from serve import wait_ready  # noqa: E402

LIMITED_FLAGS = ["--max-num-seqs", "8", "--max-waiting-requests", "8", "--max-waiting-tokens", "4096",
                 "--write-timeout", "5", "--drain-timeout", "3", "--request-timeout", "120"]
BASELINE_FLAGS = ["--max-num-seqs", "8"]  # the admission limits at their defaults (1024 requests, 2^20 tokens)
STALLED_RECEIVE_BUFFER = 2048  # bytes: the kernel holds little for a client that never reads


class Run:
    """One server, its clients and a once-a-second sampler of what it reports."""

    def __init__(self, flags: list[str]) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = flags
        self.process = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(self.port), *flags],
                                        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.start = 0.0
        self.outcomes: list[Outcome] = []
        self.samples: list[dict[str, Any]] = []
        self.notes: dict[str, Any] = {}

    def now(self) -> float:
        return time.perf_counter() - self.start

    def rss_mib(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
        except OSError:
            return None
        return None

    async def one_request(self, session: aiohttp.ClientSession, phase: Phase, rng: random.Random) -> Outcome:
        prompt = [rng.randrange(1000, 40000) for _ in range(phase.prompt_tokens)]
        body = {"prompt": prompt, "max_tokens": phase.output_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0, "stream_options": {"include_usage": True}, "repetition_detection": False}
        sent = time.perf_counter()
        outcome = Outcome(phase.name, sent - self.start, 0)
        async with session.post(self.url + "/v1/completions", json=body) as response:
            outcome.status = response.status
            if response.status != 200:
                error = (await response.json(content_type=None)).get("error", {})
                outcome.error_code, outcome.error_type = error.get("code"), error.get("type")
                outcome.error_message = error.get("message")
                outcome.retry_after = response.headers.get("Retry-After")
                return outcome
            stamps: list[float] = []
            async for line in response.content:
                if line.startswith(b"data: [DONE]"):
                    outcome.done = True
                if not line.startswith(b"data: {"):
                    continue
                event = orjson.loads(line[6:])
                if "error" in event:
                    outcome.error_code, outcome.error_type = event["error"].get("code"), event["error"].get("type")
                for choice in event.get("choices") or ():
                    if choice.get("text"):
                        stamps.append(time.perf_counter())
                    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                if event.get("usage"):
                    outcome.tokens = event["usage"]["completion_tokens"]
        outcome.tokens = outcome.tokens or len(stamps)  # a stream the drain cut ends without its usage chunk
        outcome.ttft = stamps[0] - sent if stamps else None
        outcome.gaps = [b - a for a, b in itertools.pairwise(stamps)]
        return outcome

    async def client(self, session: aiohttp.ClientSession, phase: Phase, seed: str, stop: asyncio.Event) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            outcome = await self.one_request(session, phase, rng)
            self.outcomes.append(outcome)
            if outcome.status == 503:  # as a well-behaved client does: come back after Retry-After
                try:
                    await asyncio.wait_for(stop.wait(), float(outcome.retry_after or 1))
                except TimeoutError:
                    pass

    async def sample(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(self.url + "/dashboard/data?since=0&window=60") as response:
            now = (await response.json())["now"]
        async with session.get(self.url + "/metrics") as response:
            metrics = parse_metrics(await response.text())
        return {"t": round(self.now(), 2), "rss_mib": self.rss_mib(), "running": now["running"],
                "waiting": now["waiting"], "waiting_tokens": now["waiting_tokens"], "prefilling": now["prefilling"],
                "kv_blocks_used": now["kv_blocks_used"], "tokens_per_s": now["tokens_per_s"],
                "inboxes": {name: stage["inbox"] for name, stage in now["stages"].items()},
                "finished": {k.split('finish_reason="')[1].split('"')[0]: v for k, v in metrics.items()
                             if k.startswith("conveyor_requests_total{")},
                "rejected": {k.split('reason="')[1].split('"')[0]: v for k, v in metrics.items()
                             if k.startswith("conveyor_admission_rejections_total{")}}

    async def sampler(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                self.samples.append(await self.sample(session))
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except TimeoutError:
                    pass

    async def phase(self, phase: Phase, session: aiohttp.ClientSession, also: asyncio.Task | None = None) -> dict:
        """Run ``phase.clients`` closed-loop clients for ``phase.seconds`` (and until ``also`` is done); each
        finishes the request it is in."""
        began, stop = self.now(), asyncio.Event()
        clients = [asyncio.create_task(self.client(session, phase, f"{phase.name}-{i}", stop))
                   for i in range(phase.clients)]
        await asyncio.sleep(phase.seconds)  # the phase's length: the load runs meanwhile
        if also is not None:
            await also
        stop.set()
        await asyncio.gather(*clients)
        return {"name": phase.name, "clients": phase.clients, "prompt_tokens": phase.prompt_tokens,
                "output_tokens": phase.output_tokens, "from_s": round(began, 2), "to_s": round(self.now(), 2),
                **summarize([o for o in self.outcomes if o.phase == phase.name], self.now() - began)}

    async def idle(self, session: aiohttp.ClientSession, bound_s: float = 60.0) -> dict:
        """After the load: how long until nothing runs or waits, then what is still held (KV blocks, inboxes)."""
        began = self.now()
        while True:
            sample = await self.sample(session)
            if (sample["running"] == 0 and sample["waiting"] == 0 and sample["prefilling"] == 0
                    and not any(sample["inboxes"].values())) or self.now() - began > bound_s:
                break
            await asyncio.sleep(0.2)  # polling the server's own report: it changes when the last step lands
        async with session.get(self.url + "/debug/stages") as response:
            stages = await response.json()
        return {"idle_after_s": round(self.now() - began, 2), "kv_blocks_used": stages["kv_blocks"]["used"],
                "kv_blocks_cached_free": stages["kv_blocks"]["cached_free"], "seats_held": stages["seats"]["held"],
                "waiting": stages["waiting"], "running": stages["running"],
                "inbox_depths": {name: s["inbox_depth"] for name, s in stages["stages"].items()},
                "rss_mib": self.rss_mib()}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(60)


async def stalled_readers(run: Run, count: int, tokens: int, until: asyncio.Event) -> list[dict]:
    """Streams whose clients never read (a tiny receive buffer) until ``until``; then what reached them."""
    body = orjson.dumps({"prompt": "Tell a very long story.", "max_tokens": tokens, "ignore_eos": True,
                         "stream": True, "temperature": 0, "repetition_detection": False})
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: conveyor\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALLED_RECEIVE_BUFFER)
        sock.connect(("127.0.0.1", run.port))
        sock.sendall(head + body)
        sockets.append(sock)
    sent = run.now()
    await until.wait()
    read_at = run.now()
    results = []
    for sock in sockets:
        received = bytearray()
        sock.settimeout(5.0)
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        sock.close()
        results.append({"sent_s": round(sent, 2), "read_from_s": round(read_at, 2), "bytes": len(received),
                        "status_line": bytes(received[:15]).decode(errors="replace"),
                        "token_events": received.count(b'"text"'), "ended_with_done": b"data: [DONE]" in received})
    return results


async def screenshot(run: Run, path: Path, after_s: float) -> dict:
    """The dashboard in headless Chromium after ``after_s`` of load: the page asks for the whole history first."""
    from tests.web.headless_chromium import HeadlessChromium, chromium_available

    if not chromium_available():
        return {"skipped": "no /usr/bin/chromium"}
    await asyncio.sleep(after_s)  # into the overload: the history then holds its rise
    began = run.now()
    try:
        async with HeadlessChromium(width=1400, height=1000) as browser:
            await browser.open(f"{run.url}/dashboard")
            await browser.wait_until("window.conveyorDashboard && window.conveyorDashboard.polls >= 3", timeout_s=90)
            path.parent.mkdir(parents=True, exist_ok=True)
            await browser.screenshot(path)
            problems = browser.problems.all()
    except (RuntimeError, AssertionError, OSError, TimeoutError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"path": os.path.relpath(path, ROOT), "browser_from_s": round(began, 2), "taken_at_s": round(run.now(), 2),
            "page_problems": problems}


async def drain_phase(run: Run, session: aiohttp.ClientSession, streams: int, output_tokens: int) -> dict:
    """Streams in flight, then SIGTERM: what /health and new requests get meanwhile, how each stream ends."""
    phase = Phase("drain", streams, 128, output_tokens, 0)
    rngs = [random.Random(7000 + i) for i in range(streams)]
    tasks = [asyncio.create_task(run.one_request(session, phase, rng)) for rng in rngs]
    while (await run.sample(session))["running"] < streams:  # until every stream decodes
        await asyncio.sleep(0.2)
    signalled = run.now()
    run.process.send_signal(signal.SIGTERM)
    probes: list[dict] = []
    while run.process.poll() is None:
        probe: dict[str, Any] = {"t": round(run.now() - signalled, 2)}
        try:
            async with session.get(run.url + "/health") as response:
                probe["health"] = [response.status, (await response.json())["status"]]
            refused = await run.one_request(session, Phase("drain_probe", 1, 16, 4, 0), random.Random(1))
            probe["new_request"] = [refused.status, refused.error_code]
        except aiohttp.ClientError as exc:
            probe["closed"] = type(exc).__name__
        probes.append(probe)
        await asyncio.sleep(0.5)
    exited = run.now()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    ends = [{"tokens": o.tokens, "finish_reason": o.finish_reason, "error_code": o.error_code, "done": o.done}
            if isinstance(o, Outcome) else {"exception": type(o).__name__} for o in outcomes]
    return {"streams": streams, "output_tokens": output_tokens, "sigterm_at_s": round(signalled, 2),
            "exit_after_s": round(exited - signalled, 2), "exit_code": run.process.returncode,
            "probes": probes, "stream_ends": ends}


async def limited_run(a: argparse.Namespace) -> dict:
    run = Run(LIMITED_FLAGS + a.server_args.split())
    try:
        await wait_ready(run.url, run.process)
        run.start = time.perf_counter()
        stop_sampling, read_stalled = asyncio.Event(), asyncio.Event()
        sampler = asyncio.create_task(run.sampler(stop_sampling))
        phases = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            phases.append(await run.phase(Phase("below_capacity", 4, 128, 64, a.phase_s / 2), session))
            stalled = asyncio.create_task(stalled_readers(run, 2, 4000, read_stalled))
            shot = asyncio.create_task(screenshot(run, Path(a.screenshot), a.phase_s * 0.6)) if a.screenshot else None
            phases.append(await run.phase(Phase("over_capacity", 64, 128, 64, a.phase_s), session, also=shot))
            phases.append(await run.phase(Phase("long_prompts", 32, 1024, 64, a.phase_s * 0.6), session))
            read_stalled.set()
            run.notes["stalled_readers"] = {"streams": await stalled, "cuts_seen_at_s": cuts_seen(run.samples)}
            run.notes["screenshot"] = await shot if shot else None
            run.notes["after_load"] = await run.idle(session)
            stop_sampling.set()
            await sampler
            run.notes["drain"] = await drain_phase(run, session, 8, 400)
        return {"server_flags": run.flags, "phases": phases, **run.notes, "per_second": per_second(run.outcomes),
                "timeline": run.samples}
    finally:
        run.stop()


async def baseline_run(a: argparse.Namespace) -> dict:
    run = Run(BASELINE_FLAGS + a.server_args.split())
    try:
        await wait_ready(run.url, run.process)
        run.start = time.perf_counter()
        stop_sampling = asyncio.Event()
        sampler = asyncio.create_task(run.sampler(stop_sampling))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            over = await run.phase(Phase("over_capacity", 64, 128, 64, a.phase_s), session)
            after = await run.idle(session)
        stop_sampling.set()
        await sampler
        return {"server_flags": run.flags, "phases": [over], "after_load": after,
                "per_second": per_second(run.outcomes),
                "peak_waiting": max(s["waiting"] for s in run.samples),
                "peak_rss_mib": max(s["rss_mib"] or 0 for s in run.samples), "timeline": run.samples}
    finally:
        run.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase-s", type=float, default=40.0, help="the over-capacity phase's length (others scale)")
    ap.add_argument("--screenshot", default=os.path.join(ROOT, "docs", "deploy-overload.png"),
                    help="where the dashboard screenshot goes ('' for none)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run with the default admission limits")
    ap.add_argument("--server-args", default="", help="more `conveyor serve` flags for both servers")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=ROOT, check=False).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=ROOT, check=False).stdout.strip())
    out = a.out or os.path.join(BENCH, "results", f"overload-cpu-{commit}.json")
    limited = asyncio.run(limited_run(a))
    baseline = None if a.no_baseline else asyncio.run(baseline_run(a))
    report = {
        "benchmark": "overload", "date": time.strftime("%Y-%m-%d"), "commit": commit, "tree_modified": dirty,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "device": "cpu", "model": "embedded SmolLM2-135M",
        "command": " ".join(["bench/overload.py", *sys.argv[1:]]),
        "notes": "closed-loop streaming clients in this process (the server's 2 cores shared with them and, while "
                 "the screenshot is taken, Chromium); a refused client waits Retry-After; times are seconds since "
                 "the load began; itl = gaps between streamed text chunks; timeline = one sample a second of "
                 "/dashboard/data's current figures, /metrics counters and the server's RSS",
        "limited": limited, "default_limits": baseline,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    emit_json(report, out)


if __name__ == "__main__":
    main()
