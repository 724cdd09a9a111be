"""CPU serving with the machine idle and with another process busy on one core: single-stream tok/s over HTTP.

Each variant is a `conveyor serve` of the embedded model started from a checkout (this one, or `--before-root`, a
checkout of an earlier commit) with extra flags; each runs once with the machine idle and once beside a busy loop
pinned to the last core this process may use. Prints JSON; asserts nothing.

    .venv/bin/python bench/cpu_threads.py [--before-root /tmp/old-checkout] [--requests 6] [--output-tokens 64]
                                          [--variant "threads=1:--cpu-threads 1"] [--out results.json]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from report import emit_json  # noqa: E402  (bench/ is on sys.path when run as a script)
from serve import level, wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def busy_core(core: int | None) -> Iterator[None]:
    """A process spinning on `core` for the duration (None: the machine stays idle)."""
    if core is None:
        yield
        return
    process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        yield
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def server(root: str, flags: list[str]) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--port", str(port), *flags], cwd=root,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(url, process))
        yield url
    finally:
        process.terminate()
        process.wait(60)


def commit_of(root: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before-root", default=None, help="a checkout of the commit to compare against")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FLAGS",
                        help="another run of this checkout with extra serve flags (repeatable)")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants = [("before", args.before_root, [])] if args.before_root else []
    variants.append(("after", ROOT, []))
    for spec in args.variant:
        name, _, flags = spec.partition(":")
        variants.append((name, ROOT, flags.split()))
    busy = sorted(os.sched_getaffinity(0))[-1]
    runs = []
    for name, root, flags in variants:
        for condition, core in (("idle", None), ("busy", busy)):
            with server(root, flags) as url, busy_core(core):
                asyncio.run(level(url, 1, 1, args.prompt_tokens, args.output_tokens, seed=0))  # warm-up
                result = asyncio.run(level(url, 1, args.requests, args.prompt_tokens, args.output_tokens, seed=1))
            runs.append({"variant": name, "commit": commit_of(root), "flags": " ".join(flags), "machine": condition,
                         "busy_core": core, "single_stream_tok_s": result["output_tok_s"],
                         "itl_ms": result["itl_ms"], "ttft_ms": result["ttft_ms"], "errors": result["errors"]})
            print(runs[-1], file=sys.stderr, flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    emit_json({
        "benchmark": "cpu_threads", "date": time.strftime("%Y-%m-%d"), "commit": commit_of(ROOT),
        "machine": f"{platform.machine()}, {cpu}, {len(os.sched_getaffinity(0))} usable cores",
        "model": "embedded SmolLM2-135M", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
        "requests": args.requests,
        "notes": "busy: a Python busy loop pinned to the last usable core while the server (unpinned) streams",
        "runs": runs,
    }, args.out)


if __name__ == "__main__":
    main()
