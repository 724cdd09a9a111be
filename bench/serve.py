"""HTTP serving benchmark: SSE clients at concurrency 1, 2, 4, ... 64 with fixed prompt and output
lengths; TTFT, inter-token latency and end-to-end p50/p99 and output tokens/s, printed as JSON.

Starts `conveyor serve` itself (or targets --url) and asserts nothing.

    .venv/bin/python bench/serve.py [--model PATH] [--max-concurrency 64] [--prompt-tokens 128] [--output-tokens 64]
                                    [--json-schema]

--json-schema constrains every output with a JSON schema (one long string field, so outputs run to
--output-tokens): the ladder then measures grammar-constrained decoding.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import socket
import subprocess
import sys
import time

import aiohttp
import orjson
from report import emit_json  # noqa: E402  (bench/ is on sys.path when run as a script)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


LONG_STRING_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4096}},
                      "required": ["text"]}


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], output_tokens: int,
                      json_schema: bool = False) -> dict:
    body = {"model": None, "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    if json_schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "long", "schema": LONG_STRING_SCHEMA}}
    start = time.perf_counter()
    stamps: list[float] = []
    chunks = tokens = 0
    async with session.post(url + "/v1/completions", json={k: v for k, v in body.items() if v is not None}) as resp:
        if resp.status != 200:
            return {"error": resp.status}
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                stamps.append(time.perf_counter())
                chunks += 1
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0] - start if stamps else None, "gaps": gaps, "e2e": end - start, "chunks": chunks,
            "tokens": tokens or chunks}


async def level(url: str, concurrency: int, requests: int, prompt_tokens: int, output_tokens: int,
                seed: int, json_schema: bool = False) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(prompt_tokens)] for _ in range(requests)]
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[dict] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            results.append(await one_request(session, url, queue.get_nowait(), output_tokens, json_schema))

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*[worker(session) for _ in range(concurrency)])
    wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    e2e = [r["e2e"] for r in ok]
    ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "output_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1), "wall_s": round(wall, 2),
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p99": ms(percentile(ttft, 99))},
        "itl_ms": {"p50": ms(percentile(gaps, 50)), "p99": ms(percentile(gaps, 99))},
        "e2e_ms": {"p50": ms(percentile(e2e, 50)), "p99": ms(percentile(e2e, 99))},
    }


async def wait_ready(url: str, process: subprocess.Popen | None, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError("the server exited during start-up")
            try:
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    parser.add_argument("--model", default=None)
    parser.add_argument("--server-args", default="", help="extra arguments for `conveyor serve`")
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--min-concurrency", type=int, default=1, help="the ladder's first level (doubling from it)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests-per-level", type=int, default=0, help="default: 2 x concurrency, at least 8")
    parser.add_argument("--json-schema", action="store_true", help="constrain every output with a JSON schema")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    process = None
    url = args.url
    if url is None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        command = [sys.executable, "-m", "cli", "serve", "--port", str(port),
                   "--max-num-seqs", str(max(64, args.max_concurrency)), *args.server_args.split()]
        if args.model:
            command += ["--model", args.model]
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(url, process))
        levels = []
        concurrency = args.min_concurrency
        while concurrency <= args.max_concurrency:
            requests = args.requests_per_level or max(8, 2 * concurrency)
            levels.append(asyncio.run(level(url, concurrency, requests, args.prompt_tokens, args.output_tokens,
                                            seed=concurrency, json_schema=args.json_schema)))
            concurrency *= 2
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    report = {
        "benchmark": "serve", "date": time.strftime("%Y-%m-%d"), "commit": commit.stdout.strip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": args.model or "embedded SmolLM2-135M",
        "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "json_schema": args.json_schema,
        "notes": "itl = gaps between streamed text chunks (one token each unless the client falls behind)",
        "levels": levels,
    }
    emit_json(report, args.out)


if __name__ == "__main__":
    main()
