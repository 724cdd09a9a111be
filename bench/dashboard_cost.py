"""What an open dashboard costs: SERVE at concurrency 64 with no dashboard open and with a client polling
/dashboard/data as the page does, in alternating runs on one server; output tok/s of each run, each mode's mean, the
cost against closed and its spread; then the two in short turns under one steady load; and what one poll costs the
server in CPU time, measured on its own.

    .venv/bin/python bench/dashboard_cost.py [--rounds 4] [--requests 256]           # CPU, the embedded model
    python3 bench/dashboard_cost.py --gpu-shape qwen3-8b [--quick]                      # GPU, random weights

The poller does what web/static/dashboard.js does: its first request asks for the whole history (since=0), each
later one for the samples after the last it has (since=<seq>), POLL_S after the previous answer came, with the
page's default latency window. Rounds alternate the order (closed, open / open, closed) so drift over the runs falls
on both modes alike; the cost's spread is over the rounds' paired differences. The clients are bench/serve.py's.
Writes bench/results/dashboard-cost-<cpu|gpu>-<commit>.json (or --out) and prints it. Asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

from report import emit_json  # noqa: E402  (bench/ is on sys.path once the lines above ran)
from serve import level, wait_ready  # noqa: E402

POLL_S = 1.0  # dashboard.js: POLL_MS, the wait after an answer before the next poll
PAGE_WINDOW_S = 60  # dashboard.html: the latency window selected by default
MODES = ("closed", "open")


class Poller:
    """The page's polling loop: counts polls, bytes and each poll's round trip."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seq: int | None = None
        self.round_trips: list[float] = []
        self.bytes = 0
        self.errors = 0

    async def poll(self, session: aiohttp.ClientSession) -> None:
        since = 0 if self.seq is None else self.seq
        started = time.perf_counter()
        async with session.get(f"{self.url}/dashboard/data?since={since}&window={PAGE_WINDOW_S}") as response:
            body = await response.read()
            if response.status != 200:
                self.errors += 1
                return
        self.round_trips.append(time.perf_counter() - started)
        self.bytes += len(body)
        self.seq = int(body.split(b'"seq":', 1)[1].split(b",", 1)[0])  # the page parses the rest, on its own machine

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            await session.get(f"{self.url}/dashboard")  # the page itself, once
            while not stop.is_set():
                await self.poll(session)
                try:
                    await asyncio.wait_for(stop.wait(), POLL_S)
                except TimeoutError:
                    pass

    def summary(self) -> dict[str, Any]:
        trips = sorted(self.round_trips)
        return {"polls": len(trips), "errors": self.errors, "bytes": self.bytes,
                "round_trip_ms_p50": round(trips[len(trips) // 2] * 1e3, 2) if trips else None,
                "round_trip_ms_max": round(trips[-1] * 1e3, 2) if trips else None}


async def loaded_run(url: str, mode: str, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    stop = asyncio.Event()
    poller = Poller(url) if mode == "open" else None
    polling = asyncio.create_task(poller.run(stop)) if poller else None
    figures = await level(url, a.concurrency, a.requests, a.prompt_tokens, a.output_tokens, seed)
    stop.set()
    if polling is not None:
        await polling
    return {"mode": mode, **figures, **({"dashboard": poller.summary()} if poller else {})}


async def streaming_clients(url: str, a: argparse.Namespace, produced: list[int], stop: asyncio.Event) -> None:
    """``a.concurrency`` closed-loop streams until ``stop``, counting every text chunk into ``produced[0]``."""
    async def client(session: aiohttp.ClientSession, seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            body = {"prompt": [rng.randrange(1000, 40000) for _ in range(a.prompt_tokens)], "stream": True,
                    "max_tokens": a.output_tokens, "ignore_eos": True, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {") and b'"text":""' not in line:
                        produced[0] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(client(session, 50_000 + i) for i in range(a.concurrency)))


async def interleaved(url: str, a: argparse.Namespace) -> dict[str, Any]:
    """One steady load for the whole measurement, the poller on and off in turns of ``a.segment_s`` (closed, open,
    open, closed, ...: a linear drift falls on both alike): tok/s of each turn. Turns this short share the machine's
    drift, which separate runs on a busy machine do not."""
    produced, stop = [0], asyncio.Event()
    load = asyncio.create_task(streaming_clients(url, a, produced, stop))
    poller = Poller(url)  # one page kept across its open turns: after the first, each poll asks since the last
    turns: dict[str, list[float]] = {mode: [] for mode in MODES}
    order = [MODES[(i + 1) // 2 % 2] for i in range(2 * a.segments)]
    try:
        await asyncio.sleep(a.segment_s * 2)  # warm: every stream running
        for mode in order:
            polling_stop = asyncio.Event()
            polling = asyncio.create_task(poller.run(polling_stop)) if mode == "open" else None
            start, before = time.perf_counter(), produced[0]
            await asyncio.sleep(a.segment_s)  # the turn's length: the load runs meanwhile
            turns[mode].append((produced[0] - before) / (time.perf_counter() - start))
            polling_stop.set()
            if polling is not None:
                await polling
    finally:
        stop.set()
        await load
    means = {mode: statistics.mean(values) for mode, values in turns.items()}
    pairs = [100 * (1 - o / c) for c, o in zip(turns["closed"], turns["open"], strict=True)]
    return {"segment_s": a.segment_s, "turns_per_mode": a.segments, "order": order,
            "mean_output_tok_s": {mode: round(v, 1) for mode, v in means.items()},
            "cost_pct": round(100 * (1 - means["open"] / means["closed"]), 2),
            "paired_cost_pct": {"mean": round(statistics.mean(pairs), 2),
                                "stdev": round(statistics.stdev(pairs), 2) if len(pairs) > 1 else None,
                                "per_pair": [round(v, 2) for v in pairs]},
            "output_tok_s": {mode: [round(v, 1) for v in values] for mode, values in turns.items()},
            "dashboard": poller.summary()}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def poll_cpu_cost(url: str, pid: int, polls: int) -> dict[str, Any]:
    """Server CPU per poll with no load: ``polls`` polls back to back (each since the one before, as the page asks),
    against the server's CPU over as long a time without them; and the first poll (the whole history) alone."""
    async with aiohttp.ClientSession() as session:
        poller = Poller(url)
        before = cpu_seconds(pid)
        await poller.poll(session)
        first_ms = (cpu_seconds(pid) - before) * 1e3
        before, started = cpu_seconds(pid), time.perf_counter()
        for _ in range(polls):
            await poller.poll(session)
        polled_cpu, wall = cpu_seconds(pid) - before, time.perf_counter() - started
    before = cpu_seconds(pid)
    await asyncio.sleep(wall)  # the same stretch without polls: the server's own idle work (its sampler, timers)
    idle_cpu = cpu_seconds(pid) - before
    per_poll_ms = max(0.0, polled_cpu - idle_cpu) * 1e3 / polls
    return {"polls": polls, "wall_s": round(wall, 2), "server_cpu_s_polling": round(polled_cpu, 3),
            "server_cpu_s_idle_same_time": round(idle_cpu, 3), "cpu_ms_per_poll": round(per_poll_ms, 3),
            "first_poll_cpu_ms": round(first_ms, 1), "bytes_per_poll": poller.bytes // max(1, polls + 1),
            "share_of_a_core_at_page_rate": round(per_poll_ms / (POLL_S * 1e3), 5),
            "clock_tick_ms": round(1e3 / os.sysconf("SC_CLK_TCK"), 1)}


def server_command(a: argparse.Namespace, port: int) -> tuple[list[str], str | None]:
    """`conveyor serve` for the embedded model, or for random weights of a GPU shape as bench/serve.py's GPU runs
    start it (bench/gpu_defaults.py); the model directory written for the shape (None: embedded)."""
    command = [sys.executable, "-m", "cli", "serve", "--port", str(port), "--max-num-seqs", str(max(64, a.concurrency))]
    if a.gpu_shape is None:
        return command + ["--device", "cpu", *a.server_args.split()], None
    from gpu import write_model_dir
    from gpu_shapes import chosen_shape

    model_dir = write_model_dir(chosen_shape(a.gpu_shape, a.quick), a.tokenizer)
    return command + ["--model", model_dir, "--load-format", "dummy", "--dtype", "bfloat16", "--device", "cuda",
                      *a.server_args.split()], model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu-shape", default=None, help="a bench/gpu_shapes.py shape: serve its random weights on CUDA")
    ap.add_argument("--quick", action="store_true", help="GPU: the shape's tiny form (the control flow)")
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, ".peer", "tokenizer"),
                    help="GPU: the tokenizer directory the shape's model directory copies")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=0, help="per run (default: 4 x concurrency)")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="default: 128 on the CPU, 512 on a GPU")
    ap.add_argument("--output-tokens", type=int, default=0, help="default: 32 on the CPU, 128 on a GPU")
    ap.add_argument("--rounds", type=int, default=4, help="runs of each mode, alternating")
    ap.add_argument("--segment-s", type=float, default=6.0, help="the interleaved turns' length (0: no such turns)")
    ap.add_argument("--segments", type=int, default=10, help="interleaved turns of each mode")
    ap.add_argument("--cost-polls", type=int, default=200, help="polls of the CPU-per-poll measurement")
    ap.add_argument("--server-args", default="", help="more `conveyor serve` flags")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gpu = a.gpu_shape is not None
    a.requests = a.requests or 4 * a.concurrency
    a.prompt_tokens = a.prompt_tokens or (512 if gpu else 128)
    a.output_tokens = a.output_tokens or (128 if gpu else 32)
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=ROOT, check=False).stdout.strip()
    out = a.out or os.path.join(BENCH, "results", f"dashboard-cost-{'gpu' if gpu else 'cpu'}-{commit}.json")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command, model_dir = server_command(a, port)
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: list[dict[str, Any]] = []
    try:
        asyncio.run(wait_ready(url, process))
        asyncio.run(level(url, a.concurrency, a.concurrency, a.prompt_tokens, a.output_tokens, 0))  # warm-up
        for round_ in range(a.rounds):
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                seed = 1000 * round_ + MODES.index(mode) + 1  # other prompts every run: no prefix-cache hits
                run = asyncio.run(loaded_run(url, mode, a, seed))
                runs.append({"round": round_, **run})
                print(f"round {round_} {mode:6s} {run['output_tok_s']:9.1f} tok/s  errors {run['errors']}",
                      file=sys.stderr, flush=True)
        turns = asyncio.run(interleaved(url, a)) if a.segment_s > 0 else None
        per_poll = asyncio.run(poll_cpu_cost(url, process.pid, a.cost_polls))
    finally:
        process.terminate()
        process.wait(120)
        if model_dir:
            shutil.rmtree(model_dir, ignore_errors=True)
    tok_s = {mode: [r["output_tok_s"] for r in runs if r["mode"] == mode] for mode in MODES}
    means = {mode: statistics.mean(values) for mode, values in tok_s.items()}
    paired = [100 * (1 - o["output_tok_s"] / c["output_tok_s"])
              for c, o in ((next(r for r in runs if r["round"] == i and r["mode"] == "closed"),
                            next(r for r in runs if r["round"] == i and r["mode"] == "open")) for i in range(a.rounds))]
    report = {
        "benchmark": "dashboard_cost", "date": time.strftime("%Y-%m-%d"), "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "device": "cuda" if gpu else "cpu",
        "model": f"{a.gpu_shape}{' (quick)' if a.quick else ''}, random weights" if gpu else "embedded SmolLM2-135M",
        "command": " ".join(["bench/dashboard_cost.py", *sys.argv[1:]]),
        "concurrency": a.concurrency, "requests_per_run": a.requests, "prompt_tokens": a.prompt_tokens,
        "output_tokens": a.output_tokens, "rounds": a.rounds, "poll_interval_s": POLL_S,
        "mean_output_tok_s": {mode: round(v, 1) for mode, v in means.items()},
        "stdev_output_tok_s": {mode: round(statistics.stdev(v), 1) if len(v) > 1 else None
                               for mode, v in tok_s.items()},
        "cost_pct": round(100 * (1 - means["open"] / means["closed"]), 2),
        "paired_cost_pct": {"per_round": [round(v, 2) for v in paired], "mean": round(statistics.mean(paired), 2),
                            "stdev": round(statistics.stdev(paired), 2) if len(paired) > 1 else None,
                            "min": round(min(paired), 2), "max": round(max(paired), 2)},
        "interleaved": turns,
        "poll_cpu_cost": per_poll,
        "notes": "cost = 1 - mean tok/s open / mean tok/s closed (positive: the open dashboard is slower); "
                 "paired: the same within each round; one server for both modes, its clients and the poller in this "
                 "process; interleaved: one steady load, the poller on and off in short turns (tok/s counted from "
                 "the streamed chunks); poll_cpu_cost: the server's CPU time (/proc) for back-to-back polls after the "
                 "load, less its CPU over as long without polls",
        "runs": runs,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    emit_json(report, out)


if __name__ == "__main__":
    main()
