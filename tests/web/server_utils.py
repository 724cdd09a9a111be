"""A live server on loopback for tests: the real aiohttp app and engine, in a thread of its own
(its own uvloop), so synchronous clients (the official openai SDK) can talk to it."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import orjson
import urllib.request
from aiohttp import web

from pipeline.engine import Engine
from tests.engine_utils import config_for
from web.app import ServerSettings, ServerState, build_app
from web.connections import make_runner
from web.metrics import ServerMetrics


class LiveServer:
    def __init__(self, model_dir: Path | str, settings: ServerSettings | None = None, **config: Any) -> None:
        self.config = config_for(model_dir, **config)
        self.settings = settings or ServerSettings(served_model_names=["tiny"])
        self.url = ""
        self.engine: Engine | None = None  # owned by the server thread; tests only poke test hooks on it
        self.state: ServerState | None = None  # likewise (tests read counters on it)
        self.runner: web.AppRunner | None = None  # likewise (tests count its open connections)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="live-server", daemon=True)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        self._ready.wait(120)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    def _run(self) -> None:
        import uvloop

        try:
            uvloop.run(self._main())
        except BaseException as exc:  # reported to the test thread
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        state = self.state = ServerState(self.settings,
                                         ServerMetrics(lambda: state.engine.stats() if state.engine else {}, "tiny"))
        state.engine = self.engine = await Engine.create(self.config)
        runner = self.runner = make_runner(build_app(state), self.settings)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        await self._stop.wait()
        await state.engine.shutdown()
        await runner.cleanup()

    # --- small synchronous helpers -------------------------------------------------------------
    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return orjson.loads(response.read())

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            return response.read().decode()

    def wait_idle(self, timeout_s: float = 60.0) -> dict:
        """Poll /debug/stages until nothing runs or waits (requests end one step after a cancel)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.get_json("/debug/stages")
            if stats["running"] == 0 and stats["prefilling"] == 0 and stats["kv_blocks"]["used"] == 0 \
                    and stats["seats"]["held"] == 0:
                return stats
            time.sleep(0.01)
        raise AssertionError(f"server did not become idle: {self.get_json('/debug/stages')}")


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Until `condition()` holds (it reads what another thread updates)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("the condition did not come true in time")
        time.sleep(0.005)


def metric_value(text: str, name: str) -> float:
    """The value of the first sample named exactly `name` (any labels) in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name if "{" in name else name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
