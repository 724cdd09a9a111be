"""What request tracing costs: SERVE at concurrency 64 with tracing off, with --trace-dir recording into files, and
with a GET /debug/trace window open, in alternating runs; output tok/s per run, each mode's mean and its cost against
off, and what the traces held. Also the hooks' own cost while off: a stage's bookkeeping timed with and without them.

    .venv/bin/python bench/tracing_cost.py [--requests 128] [--rounds 3]            # CPU, the embedded model
    python3 bench/tracing_cost.py --device cuda [--shape qwen3-8b] [--quick]         # GPU, random weights

Two servers run side by side (the same flags, each half the GPU's memory), one of them with --trace-dir: "off" and
"session" load the first (a /debug/trace window opened before the load and held until it ends), "trace_dir" the
second, in an order that rotates every round. The clients are bench/serve.py's. Separate runs drift with whatever
else the machine does, so after them one engine in this process serves a steady load while the three modes take
turns of --segment-s (interleaved_in_process). Writes bench/results/tracing-cost-<device>-<commit>.json (or --out)
and prints it. Asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import aiohttp
import orjson

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCH)

from report import emit_json  # noqa: E402
from serve import level, wait_ready  # noqa: E402

MODES = ("off", "trace_dir", "session")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(port), *args], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, f"http://127.0.0.1:{port}"


async def run_session(url: str, a: argparse.Namespace, seed: int, window_s: float) -> tuple[dict, dict]:
    """One load with a /debug/trace window open from before its first request (the response's headers come once
    the recording runs) to after its last; the load's figures and what the trace held."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(f"{url}/debug/trace?seconds={window_s:.1f}") as response:
            assert response.status == 200, await response.text()
            started = time.perf_counter()
            figures = await level(url, a.concurrency, a.requests, a.prompt_tokens, a.output_tokens, seed)
            loaded = time.perf_counter() - started
            body = await response.read()
    trace = orjson.loads(body)
    other = trace["otherData"]
    held = {"window_s": window_s, "load_s": round(loaded, 2), "covered": loaded <= window_s,
            "events": len(trace["traceEvents"]), "bytes": len(body), "requests": other["requests"],
            "steps": other["steps"], "device_busy_ms": other["device_busy_ms"],
            "device_idle_ms": other["device_idle_ms"], "events_dropped": other["events_dropped"]}
    return figures, held


async def interleaved(a: argparse.Namespace, model_dir: str | None, segment_s: float, segments: int) -> dict:
    """One engine in this process under a steady load of ``a.concurrency`` clients, recording off, in a session, and
    continuously into files (a TraceFiles writer, as --trace-dir runs it) in turns of ``segment_s``: the tok/s of
    each turn. Turns this short share the machine's drift, which separate server runs on a busy machine do not."""
    import random

    from pipeline.config import EngineConfig
    from pipeline.engine import Engine
    from pipeline.request import SamplingParams
    from pipeline.trace_files import TraceFiles

    config = (EngineConfig(device="cpu", max_num_seqs=max(64, a.concurrency)) if model_dir is None else
              EngineConfig(model=model_dir, load_format="dummy", dtype="bfloat16", device=a.device,
                           max_num_seqs=max(64, a.concurrency)))
    engine = await Engine.create(config)
    produced, stop = [0], asyncio.Event()

    async def client(seed: int) -> None:
        """Requests of 0.5x to 1.5x the output length, so the clients drift apart and the load stays steady (equal
        ones would start and end together: whole turns of prefill alone)."""
        rng = random.Random(seed)
        while not stop.is_set():
            prompt = [rng.randrange(1000, 20000) for _ in range(a.prompt_tokens)]
            params = SamplingParams(max_tokens=rng.randint(max(1, a.output_tokens // 2), a.output_tokens * 3 // 2),
                                    ignore_eos=True, temperature=0)
            async for delta in engine.generate(prompt_token_ids=prompt, params=params):
                produced[0] += len(delta.token_ids)

    trace_dir = tempfile.mkdtemp(prefix="conveyor-traces-")
    files = TraceFiles(engine.trace, trace_dir, 60.0, 4, tuple(stage.name for stage in engine.stages))
    clients = [asyncio.create_task(client(i)) for i in range(a.concurrency)]
    turns: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        await asyncio.sleep(3 * segment_s)  # warm: the batch fills and the clients drift apart
        for turn in range(segments * len(MODES)):
            cycle = turn // len(MODES)  # each cycle of turns starts one mode later, so drift favours none
            mode = MODES[(turn + cycle) % len(MODES)]
            writer = None
            if mode == "session":
                engine.trace.begin_session()
            elif mode == "trace_dir":
                engine.trace.set_continuous(True)
                writer = asyncio.create_task(files.run())
            start, before = time.perf_counter(), produced[0]
            await asyncio.sleep(segment_s)  # the turn's length: the load runs meanwhile
            turns[mode].append((produced[0] - before) / (time.perf_counter() - start))
            if mode == "session":
                engine.trace.end_session()
            elif writer is not None:
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
                await files.write()
                engine.trace.set_continuous(False)
    finally:
        stop.set()
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await engine.shutdown()
        shutil.rmtree(trace_dir, ignore_errors=True)
    means = {mode: statistics.mean(values) for mode, values in turns.items()}
    return {"segment_s": segment_s, "turns_per_mode": segments,
            "mean_output_tok_s": {mode: round(v, 1) for mode, v in means.items()},
            "cost_vs_off_pct": {mode: round(100 * (1 - means[mode] / means["off"]), 2) for mode in MODES[1:]},
            "output_tok_s": {mode: [round(v, 1) for v in values] for mode, values in turns.items()}}


def hooks_off_ns(calls: int = 400_000) -> dict[str, float]:
    """ns a call of Stage.record (the hook every stage reaches per service span) costs with its trace hook, off,
    against the same bookkeeping without it: what tracing costs when it is not recording."""
    from pipeline.stage import Stage

    class Unhooked(Stage):
        def record(self, started: float, batch: int, produced: int) -> None:  # Stage.record less its hook
            self.metrics.service_time.observe(time.monotonic() - started)
            self.metrics.batch_size.observe(batch)
            self.metrics.items_out += produced

    def batch_ns(stage: Stage, calls: int) -> float:
        start = time.perf_counter_ns()
        for _ in range(calls):
            stage.record(0.0, 4, 4)
        return (time.perf_counter_ns() - start) / calls

    hooked_stage, plain_stage = Stage(4), Unhooked(4)
    hooked = plain = float("inf")
    for _ in range(40):  # interleaved, the best of each: a loaded machine's noise only adds
        hooked = min(hooked, batch_ns(hooked_stage, calls // 40))
        plain = min(plain, batch_ns(plain_stage, calls // 40))
    return {"record_ns": round(hooked, 1), "record_without_hook_ns": round(plain, 1),
            "hook_off_ns": round(hooked - plain, 1)}


def server_args(a: argparse.Namespace) -> tuple[list[str], str | None]:
    """The flags both servers take, and the model directory written for a GPU shape (None: the embedded model)."""
    common = ["--max-num-seqs", str(max(64, a.concurrency))]
    if a.device == "cpu":
        return common + ["--device", "cpu", *a.server_args.split()], None
    from gpu import write_model_dir
    from gpu_shapes import chosen_shape

    model_dir = write_model_dir(chosen_shape(a.shape, a.quick), a.tokenizer)
    return common + ["--model", model_dir, "--load-format", "dummy", "--dtype", "bfloat16", "--device", a.device,
                     "--gpu-memory-utilization", "0.45", *a.server_args.split()], model_dir


def main() -> None:
    from pipeline.cpu_threads import prefer_passive_wait

    prefer_passive_wait()  # before torch loads: the in-process engine's OpenMP threads sleep when they wait, as served
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu (the embedded model) or cuda (random weights of --shape)")
    ap.add_argument("--shape", default="qwen3-8b", help="GPU: a bench/gpu_shapes.py shape")
    ap.add_argument("--quick", action="store_true", help="GPU: the shape's tiny form (the control flow)")
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, ".peer", "tokenizer"),
                    help="GPU: the tokenizer directory the shapes' model directories copy")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=0, help="per run (default: 4 x concurrency)")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="default: 128 on the CPU, 512 on a GPU")
    ap.add_argument("--output-tokens", type=int, default=0, help="default: 32 on the CPU, 128 on a GPU")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode, alternating")
    ap.add_argument("--server-args", default="", help="more `conveyor serve` flags for both servers")
    ap.add_argument("--segment-s", type=float, default=8.0, help="the in-process turns' length (0: no such turns)")
    ap.add_argument("--segments", type=int, default=4, help="in-process turns of each mode")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gpu = a.device != "cpu"
    a.requests = a.requests or 4 * a.concurrency
    a.prompt_tokens = a.prompt_tokens or (512 if gpu else 128)
    a.output_tokens = a.output_tokens or (128 if gpu else 32)
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=ROOT).stdout.strip()
    out = a.out or os.path.join(BENCH, "results", f"tracing-cost-{'gpu' if gpu else 'cpu'}-{commit}.json")
    trace_dir = tempfile.mkdtemp(prefix="conveyor-traces-")
    common, model_dir = server_args(a)
    plain, plain_url = start_server(common)
    traced, traced_url = start_server(common + ["--trace-dir", trace_dir])
    runs: list[dict[str, Any]] = []
    try:
        for url, process in ((plain_url, plain), (traced_url, traced)):
            asyncio.run(wait_ready(url, process))
            asyncio.run(level(url, a.concurrency, a.concurrency, a.prompt_tokens, a.output_tokens, 0))  # warm-up
        window_s = 60.0
        for round_ in range(a.rounds):
            order = MODES[round_ % 3:] + MODES[:round_ % 3]
            for mode in order:
                seed = 1000 * round_ + MODES.index(mode)  # other prompts every run: no prefix-cache hits
                held = None
                if mode == "session":
                    figures, held = asyncio.run(run_session(plain_url, a, seed, window_s))
                else:
                    figures = asyncio.run(level(traced_url if mode == "trace_dir" else plain_url, a.concurrency,
                                                a.requests, a.prompt_tokens, a.output_tokens, seed))
                if mode == "off":  # the next window: this load's length and a wide margin, within the endpoint's bound
                    window_s = min(60.0, round(figures["wall_s"] * 3.0 + 5.0, 1))
                runs.append({"round": round_, "mode": mode, **figures, **({"trace": held} if held else {})})
                print(f"round {round_} {mode:9s} {figures['output_tok_s']:9.1f} tok/s  errors {figures['errors']}",
                      file=sys.stderr, flush=True)
    finally:
        for process in (plain, traced):
            process.terminate()
        for process in (plain, traced):
            process.wait(120)
    files = sorted(os.listdir(trace_dir))
    dir_bytes = sum(os.path.getsize(os.path.join(trace_dir, f)) for f in files)
    shutil.rmtree(trace_dir, ignore_errors=True)
    turns = asyncio.run(interleaved(a, model_dir, a.segment_s, a.segments)) if a.segment_s > 0 else None
    if model_dir:
        shutil.rmtree(model_dir, ignore_errors=True)
    means = {mode: statistics.mean(r["output_tok_s"] for r in runs if r["mode"] == mode) for mode in MODES}
    report = {
        "benchmark": "tracing_cost", "date": time.strftime("%Y-%m-%d"), "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "device": a.device,
        "model": f"{a.shape}{' (quick)' if a.quick else ''}, random weights" if gpu else "embedded SmolLM2-135M",
        "concurrency": a.concurrency, "requests_per_run": a.requests, "prompt_tokens": a.prompt_tokens,
        "output_tokens": a.output_tokens, "rounds": a.rounds,
        "mean_output_tok_s": {mode: round(v, 1) for mode, v in means.items()},
        "cost_vs_off_pct": {mode: round(100 * (1 - means[mode] / means["off"]), 2) for mode in MODES[1:]},
        "trace_dir": {"files": len(files), "bytes": dir_bytes},
        "interleaved_in_process": turns,
        "hooks_off": hooks_off_ns(),
        "notes": "cost = 1 - mean tok/s of the mode / mean tok/s off; server runs alternate (the first mode rotates "
                 "each round); 'off' and 'session' share one server, 'trace_dir' is a second one with the same flags; "
                 "interleaved_in_process: one engine, the modes in turns under one steady load",
        "runs": runs,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    emit_json(report, out)


if __name__ == "__main__":
    main()
