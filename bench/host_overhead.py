"""Host time per decode step with a null device: the step's math costs nothing, so what is timed is
everything the host does per token: scheduling, step inputs, the sampling batch, grammar bitmasks,
detokenization, stop strings, the output channels, and (--http) SSE writes to real HTTP clients
(run in a separate process, as real clients are).

The embedded SmolLM2 model is loaded for its tokenizer and limits; the executor is then bound to a
null launch that does the runner's host work (step inputs, sampling batch, grammar bitmask fill)
and "samples" without math: a hash of the position, or for a constrained row the lowest token its
grammar allows.

    python bench/host_overhead.py --all --out bench/results/host-overhead.json   # every mode, subprocesses
    python bench/host_overhead.py --batch 1 32 256 --http --grammar               # one mode
CONVEYOR_PURE_PYTHON=1 selects the pure-Python twins of the Cython modules (--all runs both).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ext  # noqa: E402
from bench.report import emit_json  # noqa: E402
from pipeline.config import EngineConfig  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.grammar.spec import GrammarSpec  # noqa: E402
from pipeline.request import SamplingParams  # noqa: E402
from pipeline.runner.sampler import SamplerOutput  # noqa: E402
from pipeline.runner.sampling_batch import SamplingBatch  # noqa: E402
from pipeline.runner.step_plan import StepPlan  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
          "items": {"type": "string"}}}, "required": ["name", "tags"]}
TARGET_MS = {1: 0.25, 256: 3.0}


class NullSample:
    def __init__(self, token_ids: np.ndarray) -> None:
        self.token_ids = torch.from_numpy(token_ids)
        self._output = SamplerOutput(token_ids, None, None, None)

    def is_ready(self) -> bool:
        return True

    def to_host(self) -> SamplerOutput:
        return self._output


def null_launch(vocab: int, block_size: int):
    step_inputs = ext.load("step_inputs")
    cpu = torch.device("cpu")

    def launch(plan: StepPlan, previous_tokens, previous_host=None) -> NullSample:
        chunks = plan.chunks
        step_inputs.build_step_inputs([c.token_ids for c in chunks], [c.start_pos for c in chunks],
                                      [c.block_ids for c in chunks], block_size)
        rows = [row for c in chunks for row in c.rows]
        # the "device's" pick, as cheap as a device's is for the host: a hash of each row's position
        ends = np.fromiter((c.start_pos + len(c.token_ids) for c in chunks for _ in c.rows), np.int64, len(rows))
        ids = (ends * 2654435761 + np.arange(len(rows)) * 97) % (vocab - 300) + 256
        if rows:
            batch = SamplingBatch.from_rows(rows, vocab, cpu)
            batch.fill_grammar_bitmask(previous_host)
            if batch.grammar_bitmask is not None:  # the "device's" pick, vectorized: lowest allowed token
                rows_ = np.asarray([entry[0] for entry in batch.grammar_rows])
                words = batch.grammar_bitmask.numpy()[rows_].view(np.uint32)
                first = (words != 0).argmax(axis=1)
                bits = words[np.arange(len(rows_)), first].astype(np.int64)
                ids[rows_] = first * 32 + np.log2(bits & -bits).astype(np.int64)
        return NullSample(ids)

    return launch


def request_params(tokens: int, grammar: bool) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, repetition_detection=False,
                          grammar=GrammarSpec.json_schema(SCHEMA) if grammar else None)


async def via_engine(engine: Engine, batch: int, tokens: int, grammar: bool) -> tuple[list[float], float]:
    firsts: list[float] = []

    async def one(i: int) -> None:
        first = True
        async for _ in engine.generate(prompt_token_ids=[300 + i, 400 + i, 500], params=request_params(tokens, grammar)):
            if first:
                firsts.append(time.perf_counter())
                first = False

    await asyncio.gather(*(one(i) for i in range(batch)))
    return firsts, time.perf_counter()


async def via_http(url: str, batch: int, tokens: int, grammar: bool) -> tuple[list[float], float]:
    """Streams from real HTTP clients in their own process (as real clients are: their parsing is not
    the server's host time); returns the clients' first-byte times and end (perf_counter: one clock)."""
    cmd = [sys.executable, __file__, "--clients", url, "--batch", str(batch), "--tokens", str(tokens)]
    process = await asyncio.create_subprocess_exec(*cmd, *(["--grammar"] if grammar else []),
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    if process.returncode:
        raise RuntimeError(f"the client process failed: {err.decode()[-2000:]}")
    firsts, end = json.loads(out)
    return firsts, end


class _SSEClient(asyncio.Protocol):
    """One streaming request over a raw socket: sends the POST, reads until the chunked body's end.
    Lean on purpose (no SSE parsing): the clients share this machine's 2 cores with the server, and
    what is measured is the server's host time, not a client library's."""

    def __init__(self, request: bytes, done: asyncio.Future) -> None:
        self.request, self.done = request, done
        self.first: float | None = None
        self.head, self.tail = b"", b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.first is None:
            self.first = time.perf_counter()
            self.head = data[:12]
        self.tail = (self.tail + data)[-5:]
        if self.tail == b"0\r\n\r\n" and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError(f"the server closed the stream early: {exc}"))


async def http_clients(url: str, batch: int, tokens: int, grammar: bool) -> tuple[list[float], float]:
    body = {"model": "m", "prompt": "hello", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "repetition_detection": False}
    if grammar:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    payload = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
    loop = asyncio.get_running_loop()
    clients = []
    for _ in range(batch):
        client = _SSEClient(request, loop.create_future())
        await loop.create_connection(lambda c=client: c, host, int(port))
        clients.append(client)
    await asyncio.gather(*(c.done for c in clients))
    end = time.perf_counter()
    if any(not c.head.startswith(b"HTTP/1.1 200") for c in clients):
        raise RuntimeError(f"a request failed: {[c.head for c in clients if not c.head.startswith(b'HTTP/1.1 200')][:1]}")
    return [c.first for c in clients if c.first is not None], end


async def measure(a: argparse.Namespace) -> dict:
    config = EngineConfig(max_num_seqs=max(a.batch), max_num_batched_tokens=max(512, 4 * max(a.batch)),
                          run_ahead=not a.disable_run_ahead,
                          num_kv_blocks=max(a.batch) * (a.tokens // 16 + 4) + 16)
    engine = await Engine.create(config)
    engine.executor.bind(null_launch(engine.loaded.limits.vocab_size, config.block_size))
    runner = url = None
    if a.http:
        from aiohttp import web

        from web.app import ServerSettings, ServerState, build_app
        from web.metrics import ServerMetrics

        state = ServerState(ServerSettings(served_model_names=["m"]), ServerMetrics(engine.stats, "m"))
        state.engine = engine
        runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    results = []
    try:
        for batch in a.batch:
            run = (lambda b, t: via_http(url, b, t, a.grammar)) if a.http else (
                lambda b, t: via_engine(engine, b, t, a.grammar))
            await run(min(batch, 8), 8)  # warm-up (grammar compiled here)
            before = engine.stats()["device_steps"]
            firsts, end = await run(batch, a.tokens)
            steps = engine.stats()["device_steps"] - before
            ms = (end - max(firsts)) / (a.tokens - 1) * 1e3  # every stream decoding: the steady state
            results.append({"batch": batch, "tokens": a.tokens, "device_steps": steps, "ms_per_step": ms,
                            "target_ms": TARGET_MS.get(batch)})
            print(f"batch {batch}: {ms:.3f} ms/step", file=sys.stderr)
    finally:
        if runner is not None:
            await runner.cleanup()
        await engine.shutdown()
    return {"http": a.http, "grammar": a.grammar, "cython": ext.is_compiled("step_inputs"),
            "run_ahead": not a.disable_run_ahead, "results": results}


def run_all(a: argparse.Namespace) -> dict:
    modes = []
    for cython in (True, False):
        for http in (False, True):
            for grammar in (False, True):
                cmd = [sys.executable, __file__, "--batch", *map(str, a.batch), "--tokens", str(a.tokens)]
                cmd += ["--http"] if http else []
                cmd += ["--grammar"] if grammar else []
                env = dict(os.environ, CONVEYOR_PURE_PYTHON="0" if cython else "1")
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                if done.returncode:
                    raise RuntimeError(done.stderr[-2000:])
                modes.append(json.loads(done.stdout))
                print(done.stderr.strip(), file=sys.stderr)
    return {"benchmark": "host_overhead", "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or ''}".strip(", "),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip(),
            "method": "null device (runner host work kept, no math); ms/step = steady-state time with every "
                      "stream decoding / (tokens - 1); --http streams SSE to real aiohttp clients",
            "targets_ms": TARGET_MS, "modes": modes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--http", action="store_true", help="through the HTTP server to real SSE clients")
    parser.add_argument("--grammar", action="store_true", help="every request json_schema-constrained")
    parser.add_argument("--all", action="store_true", help="every mode (Cython on/off x http x grammar)")
    parser.add_argument("--disable-run-ahead", action="store_true", help="each step waits for the previous")
    parser.add_argument("--out", default=None)
    parser.add_argument("--clients", metavar="URL", help=argparse.SUPPRESS)  # the client process of --http
    a = parser.parse_args()
    if a.clients:
        print(json.dumps(asyncio.run(http_clients(a.clients, a.batch[0], a.tokens, a.grammar))))
        return
    report = run_all(a) if a.all else asyncio.run(measure(a))
    emit_json(report, a.out)


if __name__ == "__main__":
    main()
