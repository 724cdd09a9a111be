"""`conveyor serve` as a real process: health while loading/ready, SIGTERM drains and exits 0."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import orjson
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            assert process.poll() is None, "the server exited while starting"
            try:
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("the server never became healthy")


@pytest.fixture
def served(tiny_model_dir):
    port = free_port()
    command = [sys.executable, "-m", "cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
               "--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "512", "--drain-timeout", "60",
               "--served-model-name", "tiny"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def test_sigterm_lets_in_flight_requests_finish_refuses_new_ones_and_exits_0(served):
    process, url = served

    async def stream_one(session, started: asyncio.Event):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 400,
                "ignore_eos": True, "stream": True, "temperature": 0}
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            await response.content.readline()
            started.set()
            return await response.read()

    async def main():
        await wait_healthy(url, process)
        async with aiohttp.ClientSession() as session:
            events = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.ensure_future(stream_one(session, e)) for e in events]
            for event in events:
                await event.wait()
            process.send_signal(signal.SIGTERM)
            refused = None
            for _ in range(1000):  # the drain begins as soon as the signal is handled
                async with session.post(url + "/v1/completions",
                                        json={"model": "tiny", "prompt": "x", "max_tokens": 2}) as response:
                    if response.status == 503:
                        refused = (response.headers.get("Retry-After"), await response.json())
                        break
                    await response.read()
                async with session.get(url + "/health") as health:
                    await health.read()
            tails = await asyncio.gather(*streams)
        return refused, tails

    refused, tails = asyncio.run(main())
    assert refused is not None and refused[0] is not None and "shutting down" in refused[1]["error"]["message"]
    for tail in tails:
        assert tail.endswith(b"data: [DONE]\n\n")
        events = [orjson.loads(e[6:]) for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # ran to max_tokens, not cut off
    assert process.wait(60) == 0
    output = process.stdout.read().decode()
    assert "draining" in output and "listening" in output
