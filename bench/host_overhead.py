"""Host time per decode step with a null device: the step's math costs nothing, so what is timed is
everything the host does per token: scheduling, step inputs, the sampling batch, grammar bitmasks,
detokenization, stop strings, the output channels, and (--http) SSE writes to real HTTP clients
(run in a separate process, as real clients are).

The embedded SmolLM2 model is loaded for its tokenizer and limits; the executor is then bound to a
null launch that does the runner's host work (step inputs, sampling batch, grammar bitmask fill)
and "samples" without math: a hash of the position, or for a constrained row that token if its grammar
allows it, else the lowest token it allows.

    python bench/host_overhead.py --all --out bench/results/host-overhead.json   # every mode, subprocesses
    python bench/host_overhead.py --batch 1 32 256 --http --grammar               # one mode
CONVEYOR_PURE_PYTHON=1 selects the pure-Python twins of the Cython modules (--all runs both).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ext  # noqa: E402
from bench.report import emit_json  # noqa: E402
from bench.sse_clients import SCHEMA  # noqa: E402
from pipeline.config import EngineConfig  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.grammar.spec import GrammarSpec  # noqa: E402
from pipeline.request import SamplingParams  # noqa: E402
from pipeline.runner.host_staging import HostStaging  # noqa: E402
from pipeline.runner.sampler import SamplerOutput  # noqa: E402
from pipeline.runner.sampling_batch import SamplingBatch  # noqa: E402
from pipeline.runner.step_plan import StepPlan  # noqa: E402

TARGET_MS = {1: 0.25, 256: 3.0}


class NullSample:
    def __init__(self, token_ids: np.ndarray) -> None:
        self.token_ids = torch.from_numpy(token_ids)
        self._output = SamplerOutput(token_ids, None, None, None)

    def is_ready(self) -> bool:
        return True

    def to_host(self) -> SamplerOutput:
        return self._output


def masked_pick(words: np.ndarray, rows: np.ndarray, slots: np.ndarray, ids: np.ndarray) -> None:
    """The "device's" pick under a grammar mask: a row's hashed id where its grammar allows it (inside a
    string it mostly does: text as varied as a model's), else the lowest allowed token. A device does
    this on its own, so it is kept off the host's clock as far as it can be: one small gather of the
    wanted words, and for the rows whose wanted token is refused one vectorized search (numpy releases
    the GIL for large copies, and the event loop then takes it). words: the step's grammar bitmask, whose row
    slots[i] masks batch row rows[i]."""
    flat = words.reshape(-1)
    rows_, slots_ = np.asarray(rows, dtype=np.int64), np.asarray(slots, dtype=np.int64)
    wanted = ids[rows_]
    bits = flat[slots_ * words.shape[1] + (wanted >> 5)] >> (wanted & 31).astype(np.uint32)
    refused_at = (bits & 1) == 0
    refused = rows_[refused_at]
    if len(refused):
        masked = words[slots_[refused_at]]
        first = np.argmax(masked != 0, axis=1)  # every grammar row allows some token
        word = masked[np.arange(len(refused)), first].astype(np.int64)
        lowest = word & -word
        ids[refused] = first * 32 + np.log2(lowest).astype(np.int64)


def null_launch(vocab: int):
    """A launch with no device: the plans arrive built (their inputs were built on the event loop)."""
    cpu = torch.device("cpu")
    staging = HostStaging()  # as the runner's

    def launch(plan: StepPlan, previous_tokens, previous_host=None) -> NullSample:
        rows = list(plan.rows)
        # the "device's" pick, as cheap as a device's is for the host: a hash of each row's position
        ends = plan.forward.positions[plan.forward.logits_indices] + 1
        ids = (ends * 2654435761 + np.arange(len(rows)) * 97) % (vocab - 300) + 256
        if rows:
            batch = SamplingBatch.from_rows(rows, vocab, cpu, staging)
            batch.fill_grammar_bitmask(previous_host)
            mask = batch.grammar_mask
            if mask is not None:
                masked_pick(mask.host_bitmask.view(np.uint32), mask.host_rows, mask.host_slots, ids)
        return NullSample(ids)

    return launch


def request_params(tokens: int, grammar: bool) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, repetition_detection=False,
                          grammar=GrammarSpec.json_schema(SCHEMA) if grammar else None)


async def via_engine(engine: Engine, batch: int, tokens: int, grammar: bool) -> tuple[list[float], float, None]:
    firsts: list[float] = []

    async def one(i: int) -> None:
        first = True
        async for _ in engine.generate(prompt_token_ids=[300 + i, 400 + i, 500],
                                       params=request_params(tokens, grammar)):
            if first:
                firsts.append(time.perf_counter())
                first = False

    await asyncio.gather(*(one(i) for i in range(batch)))
    return firsts, time.perf_counter(), None


async def via_http(url: str, batch: int, tokens: int, grammar: bool, poll_ms: float,
                   nice: int) -> tuple[list[float], float, float]:
    """Streams from real HTTP clients in their own process (as real clients are: their parsing is not
    the server's host time); returns the clients' first-byte times and end (perf_counter: one clock),
    and the client process's CPU seconds while reading."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "sse_clients.py"), url, str(batch), str(tokens), str(poll_ms),
           str(nice), *(["--grammar"] if grammar else [])]
    # Popen (vfork), not the event loop's subprocess: uvloop spawns with fork(), which write-protects
    # every page of this multi-GB server process, and each page the server writes afterwards faults
    # once, all run long (batch 256 with grammars: 57 -> 32 page faults per step, 2.5-5 us each on
    # this VM; the rest are the matchers' growing histories): a cost of the bench's client launch
    # that a serving engine never pays.
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.to_thread(process.communicate)
    if process.returncode:
        raise RuntimeError(f"the client process failed: {err.decode()[-2000:]}")
    firsts, end, cpu = json.loads(out)
    return firsts, end, cpu


class CollectorPauses:
    """Python's cyclic GC pauses (start, seconds), from gc.callbacks: they stop every thread."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float]] = []
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((self._started, time.perf_counter() - self._started))

    def between(self, t0: float, t1: float) -> list[float]:
        return [seconds for start, seconds in self.pauses if t0 <= start <= t1]


def speed_reference_ms(rounds: int = 5) -> float:
    """Median ms of a fixed single-threaded Python workload (small objects, dict and list work, like the
    event loop's per-row work), run before and after a measurement: this VM's speed drifts by up to 2x
    between spells, and ms_per_step / reference_ms compares runs taken in different spells."""
    def work() -> int:
        table = {i: (i, str(i)) for i in range(20_000)}
        return sum(len(table[i][1]) for i in range(20_000))

    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return sorted(times)[rounds // 2] * 1e3


def thread_clocks(engine: Engine) -> dict[str, int]:
    """CPU clock ids of the threads doing per-step work: the event loop (this one) and the device thread."""
    clocks = {"event_loop": time.pthread_getcpuclockid(threading.get_ident()),
              "device_thread": time.pthread_getcpuclockid(engine.executor._thread.ident)}  # type: ignore[arg-type]
    return clocks


async def sample_full_batch(engine: Engine, batch: int,
                            samples: list[tuple[float, int, dict[str, float], int]]) -> None:
    """(time, device steps, CPU time per thread, the process's minor page faults) while all `batch`
    sequences decode: the steady state, measured on the server whatever the clients' read timing.
    Every 2 ms (this runs on the server's event loop: each wake-up is host time the server does not
    spend, so not every millisecond; a batch-1 run of 256 tokens lasts ~30 ms, so not much rarer
    either), with the thread clocks."""
    clocks = thread_clocks(engine)
    while True:
        if len(engine.decode.running) == batch:
            cpu = {name: time.clock_gettime(clock) for name, clock in clocks.items()}
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            samples.append((time.perf_counter(), engine.executor.steps, cpu, faults))
        await asyncio.sleep(0.002)


async def measure(a: argparse.Namespace) -> dict:
    config = EngineConfig(max_num_seqs=max(a.batch), max_num_batched_tokens=max(512, 4 * max(a.batch)),
                          run_ahead=not a.disable_run_ahead,
                          num_kv_blocks=max(a.batch) * (a.tokens // 16 + 4) + 16,
                          **({"gil_switch_interval_s": a.gil_switch_interval} if a.gil_switch_interval else {}))
    engine = await Engine.create(config)
    collector = CollectorPauses()
    engine.executor.bind(null_launch(engine.loaded.limits.vocab_size))
    runner = url = None
    if a.http:
        from aiohttp import web

        from web.app import ServerSettings, ServerState, build_app
        from web.metrics import ServerMetrics

        state = ServerState(ServerSettings(served_model_names=["m"]), ServerMetrics(engine.stats, "m"))
        state.engine = engine
        runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
        await runner.setup()
        if a.unix:
            socket_path = os.path.join(tempfile.mkdtemp(prefix="conveyor-bench-"), "server.sock")
            site: web.BaseSite = web.UnixSite(runner, socket_path)
            url = f"unix:{socket_path}"
        else:
            site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        if not a.unix:
            url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    results = []
    reference_before = speed_reference_ms()
    try:
        for batch in a.batch:
            run = (lambda b, t: via_http(url, b, t, a.grammar, a.client_poll_ms, a.client_nice)) if a.http else (
                lambda b, t: via_engine(engine, b, t, a.grammar))
            await run(min(batch, 8), 8)  # warm-up (grammar compiled here)
            samples: list[tuple[float, int, dict[str, float], int]] = []
            sampler = asyncio.create_task(sample_full_batch(engine, batch, samples))
            firsts, end, client_cpu = await run(batch, a.tokens)
            sampler.cancel()
            if len(samples) < 2 or samples[-1][1] == samples[0][1]:
                raise RuntimeError(f"batch {batch}: no steady state with all sequences decoding was sampled")
            (t0, steps0, cpu0, faults0), (t1, steps1, cpu1, faults1) = samples[0], samples[-1]
            steps = steps1 - steps0
            ms = (t1 - t0) / steps * 1e3
            cpu = {name: (cpu1[name] - cpu0[name]) / steps * 1e3 for name in cpu0}
            pauses = collector.between(t0, t1)
            results.append({"batch": batch, "tokens": a.tokens, "steady_steps": steps, "ms_per_step": ms,
                            "cpu_ms_per_step": cpu,
                            "gc": {"collections": len(pauses), "ms_per_step": sum(pauses) / steps * 1e3,
                                   "max_pause_ms": max(pauses, default=0.0) * 1e3},
                            "page_faults_per_step": (faults1 - faults0) / steps,
                            "client_view_ms_per_step": (end - max(firsts)) / (a.tokens - 1) * 1e3,
                            "target_ms": TARGET_MS.get(batch)})
            if client_cpu is not None:
                results[-1]["client_process_cpu_ms_per_step"] = client_cpu / a.tokens * 1e3
            print(f"batch {batch}: {ms:.3f} ms/step (CPU ms/step: "
                  + ", ".join(f"{name} {value:.3f}" for name, value in cpu.items())
                  + (f", clients {client_cpu / a.tokens * 1e3:.3f}" if client_cpu is not None else "")
                  + f") [speed reference {reference_before:.2f} ms]", file=sys.stderr)
    finally:
        if runner is not None:
            await runner.cleanup()
        await engine.shutdown()
    return {"http": a.http, "transport": ("unix" if a.unix else "tcp") if a.http else None, "grammar": a.grammar,
            "cython": ext.is_compiled("step_inputs"),
            "run_ahead": not a.disable_run_ahead, "client_nice": a.client_nice,
            "speed_reference_ms": {"before": reference_before, "after": speed_reference_ms()}, "results": results}


def run_all(a: argparse.Namespace) -> dict:
    """Every mode, each in a fresh process `--repeat` times (interleaved, so a slow spell of a shared
    VM hits every mode alike); a result's ms_per_step is the median of its runs, all runs kept."""
    modes: dict[tuple[bool, str, bool], list[dict]] = {}
    for _ in range(a.repeat):
        for cython in (True, False):
            for path in ("engine", "http-tcp", "http-unix"):
                for grammar in (False, True):
                    cmd = [sys.executable, __file__, "--batch", *map(str, a.batch), "--tokens", str(a.tokens)]
                    cmd += ["--http"] if path != "engine" else []
                    cmd += ["--unix"] if path == "http-unix" else []
                    cmd += ["--grammar"] if grammar else []
                    cmd += ["--client-nice", str(a.client_nice)]
                    env = dict(os.environ, CONVEYOR_PURE_PYTHON="0" if cython else "1")
                    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                    if done.returncode:
                        raise RuntimeError(done.stderr[-2000:])
                    modes.setdefault((cython, path, grammar), []).append(json.loads(done.stdout))
                    print(f"{'cython' if cython else 'twins'} {path} grammar={grammar}: {done.stderr.strip()}",
                          file=sys.stderr)
    return {"benchmark": "host_overhead", "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}",
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip(),
            "method": "null device (runner host work kept, no math); ms/step = steady-state time with every "
                      "stream decoding, measured on the server; --http streams SSE to raw-socket clients in "
                      "another process; median of --repeat runs",
            "targets_ms": TARGET_MS, "modes": [median_of_runs(runs) for runs in modes.values()]}


def median_of_runs(runs: list[dict]) -> dict:
    """The first run's record with each batch's figures replaced by the run with the median ms_per_step."""
    merged = dict(runs[0], results=[])
    for i, first in enumerate(runs[0]["results"]):
        ranked = sorted((run["results"][i] for run in runs), key=lambda result: result["ms_per_step"])
        median = dict(ranked[len(ranked) // 2])
        median["runs_ms_per_step"] = [run["results"][i]["ms_per_step"] for run in runs]
        merged["results"].append(median)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--http", action="store_true", help="through the HTTP server to real SSE clients")
    parser.add_argument("--unix", action="store_true",
                        help="with --http: clients connect over a Unix socket instead of TCP loopback, whose send "
                             "calls also run the receiving client's TCP stack on the server's thread")
    parser.add_argument("--client-poll-ms", type=float, default=0.0,
                        help="with --http: clients read every this many ms instead of blocking "
                             "(see bench/sse_clients.py)")
    parser.add_argument("--client-nice", type=int, default=0,
                        help="with --http: the client process runs at this nice value (see bench/sse_clients.py)")
    parser.add_argument("--grammar", action="store_true", help="every request json_schema-constrained")
    parser.add_argument("--all", action="store_true", help="every mode (Cython on/off x http x grammar)")
    parser.add_argument("--repeat", type=int, default=1, help="with --all: runs per mode (the median is reported)")
    parser.add_argument("--disable-run-ahead", action="store_true", help="each step waits for the previous")
    parser.add_argument("--gil-switch-interval", type=float, default=None,
                        help="seconds (the engine's setting while it serves; default: the engine's default)")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    import uvloop
    report = run_all(a) if a.all else uvloop.run(measure(a))
    emit_json(report, a.out)


if __name__ == "__main__":
    main()
