"""Startup says how it went: bad flags are one usage error, a feature the model lacks is one `conveyor: error:`
line, and /metrics and /health answer while the model loads."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from cli.main import main
from pipeline.engine import Engine
from tests.engine_utils import config_for
from tests.web.test_serve_process import free_port
from web.app import ServerSettings
from web.serve import run_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))

BAD_FLAGS = [
    (["--num-speculative-tokens", "-1"], "--num-speculative-tokens"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--num-kv-blocks", "-3"], "--num-kv-blocks"),
    (["--kv-cache-memory-gib", "0"], "--kv-cache-memory-gib"),
    (["--request-timeout", "-1"], "--request-timeout"),
    (["--write-timeout", "0"], "--write-timeout"),
    (["--header-timeout", "nan"], "--header-timeout"),
    (["--max-output-buffer-bytes", "0"], "--max-output-buffer-bytes"),
    (["--port", "70000"], "--port"),
    (["--block-size", "3"], "power of two"),
    (["--speculative-method", "ngram"], "num_speculative_tokens"),
]


@pytest.mark.parametrize("flags,needle", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_value_is_one_usage_error(capsys, flags, needle):
    with pytest.raises(SystemExit) as exited:
        main(["serve", *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("conveyor serve: error: ") and needle in errors[0], err
    assert err.startswith("usage: conveyor serve")


def test_a_feature_the_model_lacks_is_one_error_line(tiny_model_dir):
    command = [sys.executable, "-m", "cli", "serve", "--model", str(tiny_model_dir), "--port",
               str(free_port()), "--device", "cpu", "--dtype", "float32", "--speculative-method", "mtp",
               "--num-speculative-tokens", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 1 and "Traceback" not in done.stderr + done.stdout, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("conveyor: error: ") and "MTP" in errors[0], done.stderr


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def poll(url: str, status: int, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got, text = get(url)
            if got == status:
                return text
        except OSError:
            pass  # not listening yet
        assert time.monotonic() < deadline, f"{url} never answered {status}"
        time.sleep(0.02)


def test_metrics_and_health_answer_while_the_model_loads(tiny_model_dir, monkeypatch):
    release = threading.Event()
    real_create = Engine.create

    async def slow_create(config, progress=None):
        await asyncio.to_thread(release.wait, 60)
        return await real_create(config, progress)

    monkeypatch.setattr(Engine, "create", slow_create)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server: dict = {}

    async def serve() -> int:
        server["loop"], server["stop"] = asyncio.get_running_loop(), asyncio.Event()
        return await run_server(config_for(tiny_model_dir), ServerSettings(served_model_names=["tiny"]), "127.0.0.1",
                                port, 1.0, say=lambda m: None, stop=server["stop"])

    thread = threading.Thread(target=lambda: server.setdefault("code", asyncio.run(serve())), daemon=True)
    thread.start()
    try:
        assert '"loading"' in poll(url + "/health", 503)
        status, loading = get(url + "/metrics")
        assert status == 200 and "conveyor_requests_total" in loading and "conveyor_kv_blocks_total" not in loading
        release.set()
        poll(url + "/health", 200)
        status, ready = get(url + "/metrics")
        assert status == 200 and "conveyor_kv_blocks_total" in ready
    finally:
        release.set()
        if "loop" in server:
            server["loop"].call_soon_threadsafe(server["stop"].set)
        thread.join(60)
    assert server.get("code") == 0
