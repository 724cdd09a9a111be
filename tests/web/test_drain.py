"""SIGTERM past the drain timeout: the requests still running are cut and say so, and the process exits within the
drain timeout plus a few seconds (killed, and the test failed, if not)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import orjson

from tests.web.stalled_clients import send_and_stall
from tests.web.test_serve_process import free_port, wait_healthy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
DRAIN_S = 1.0
EXIT_WITHIN_S = DRAIN_S + 8.0  # the cut's grace, the handlers' shutdown, the engine's last step, a loaded machine
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1000, "ignore_eos": True}


def sse_events(raw: bytes) -> list[dict | str]:
    return [orjson.loads(e[6:]) if e.startswith(b"data: {") else e.decode() for e in raw.split(b"\n\n") if e]


def test_drain_timeout_cuts_requests_with_length_and_an_error_then_exits(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
               "--device", "cpu", "--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "8192",
               "--max-num-seqs", "16", "--cpu-threads", "1", "--drain-timeout", str(DRAIN_S),
               "--served-model-name", "tiny"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)

    async def stream(session, started: asyncio.Event) -> bytes:
        async with session.post(url + "/v1/chat/completions", json={**LONG, "stream": True}) as response:
            assert response.status == 200
            await response.content.readline()
            started.set()
            return await response.read()

    async def plain(session) -> tuple[int, dict]:
        async with session.post(url + "/v1/chat/completions", json=LONG) as response:
            return response.status, await response.json()

    async def main():
        await wait_healthy(url, process)
        async with aiohttp.ClientSession() as session:
            started = [asyncio.Event() for _ in range(8)]
            streams = [asyncio.ensure_future(stream(session, e)) for e in started]
            plains = [asyncio.ensure_future(plain(session)) for _ in range(2)]
            stalled = [await send_and_stall(url, "/v1/chat/completions", {**LONG, "stream": True}) for _ in range(2)]
            for event in started:
                await event.wait()
            deadline = time.monotonic() + 60
            while True:  # every request is generating
                async with session.get(url + "/debug/stages") as response:
                    if (await response.json())["running"] == 12:
                        break
                assert time.monotonic() < deadline, "the requests never all ran"
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            tails = await asyncio.gather(*streams)
            answers = await asyncio.gather(*plains)
        try:
            code = await asyncio.to_thread(process.wait, EXIT_WITHIN_S)
        finally:
            for sock in stalled:
                sock.close()
        return tails, answers, code, time.monotonic() - signalled

    try:
        tails, answers, code, took = asyncio.run(main())
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
    output = process.stdout.read().decode()
    assert code == 0 and took < EXIT_WITHIN_S and "drain timeout" in output, output[-2000:]
    for tail in tails:
        events = sse_events(tail)
        assert events[-1] == "data: [DONE]"
        chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # a cut answer says "length"
        assert [e["code"] for e in errors] == ["server_shutting_down"] and events[-2] == {"error": errors[0]}
    for status, body in answers:
        assert status == 503 and body["error"]["code"] == "server_shutting_down"
