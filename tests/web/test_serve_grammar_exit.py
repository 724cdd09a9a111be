"""`conveyor serve` exits on SIGTERM while xgrammar compiles a grammar that would take a minute: the compile's
thread (native code nothing can interrupt) never keeps the process alive."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp

from tests.web.test_serve_process import free_port, wait_healthy

# An object of 3,000 optional properties: about a minute of xgrammar's compile on a laptop core (76 KB of schema,
# under the default --max-grammar-bytes).
SLOW_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}


def test_sigterm_exits_while_a_grammar_compiles(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
               "--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "512", "--drain-timeout", "1",
               "--served-model-name", "tiny", "--max-grammar-seconds", "120"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

    async def compile_then_signal() -> float:
        await wait_healthy(url, process)
        async with aiohttp.ClientSession() as session:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW_SCHEMA}}}
            request = asyncio.ensure_future(session.post(url + "/v1/chat/completions", json=body))
            deadline = time.monotonic() + 60
            while True:  # until the compile runs
                assert time.monotonic() < deadline, "the compile never started"
                async with session.get(url + "/debug/stages") as response:
                    stats = await response.json()
                grammar = stats.get("grammar") or {}
                if stats["stages"]["intake"]["items_in"] >= 1 and grammar.get("running", 1) >= 1:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # well inside xgrammar's native compile
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
            return signalled

    try:
        signalled = asyncio.run(compile_then_signal())
        try:
            code = process.wait(15)
        except subprocess.TimeoutExpired:
            raise AssertionError("the server did not exit within 15 s of SIGTERM while a grammar compiled") from None
        assert code == 0
        assert time.monotonic() - signalled < 15
        assert "stopped" in process.stdout.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
