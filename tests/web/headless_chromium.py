"""Headless Chromium driven over the Chrome DevTools protocol with aiohttp's websocket client (no other dependency):
load a page, collect its console errors and uncaught exceptions, evaluate JavaScript in it, take a screenshot.

Chromium is Debian's package (`apt-get install chromium`, /usr/bin/chromium); tests skip without it.
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = "/usr/bin/chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars")
LISTENING = "DevTools listening on "


def chromium_available() -> bool:
    return os.access(CHROMIUM, os.X_OK)


@dataclass(slots=True)
class PageProblems:
    """What the page reported as wrong: console.error / console.assert calls, uncaught exceptions, and browser log
    entries of level error (a resource that failed to load, a CSP violation)."""

    console: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def all(self) -> list[str]:
        return [*self.console, *self.exceptions, *self.log]


class HeadlessChromium:
    """``async with HeadlessChromium() as browser: await browser.open(url)``; one page."""

    def __init__(self, width: int = 1400, height: int = 1000, start_timeout_s: float = 30.0) -> None:
        self.width, self.height, self.start_timeout_s = width, height, start_timeout_s
        self.problems = PageProblems()
        self._profile = ""
        self._process: subprocess.Popen[str] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._socket: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}

    async def __aenter__(self) -> HeadlessChromium:
        self._profile = tempfile.mkdtemp(prefix="conveyor-chromium-")
        self._process = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-port=0",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            browser_url = await asyncio.wait_for(asyncio.to_thread(self._devtools_url), self.start_timeout_s)
            self._session = aiohttp.ClientSession()
            port = browser_url.split("//", 1)[1].split("/", 1)[0]
            async with self._session.get(f"http://{port}/json/list") as response:
                targets = await response.json()
            page = next(t for t in targets if t["type"] == "page")
            self._socket = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
            self._reader = asyncio.create_task(self._read())
            for domain in ("Runtime", "Log", "Page"):
                await self.send(f"{domain}.enable")
            await self.send("Emulation.setDeviceMetricsOverride",
                            {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False})
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._socket is not None:
            await self._socket.close()
        if self._session is not None:
            await self._session.close()
        if self._process is not None:
            self._process.terminate()
            try:
                await asyncio.to_thread(self._process.wait, 10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                await asyncio.to_thread(self._process.wait)
            if self._process.stderr is not None:
                self._process.stderr.close()
        if self._profile:
            shutil.rmtree(self._profile, ignore_errors=True)

    def _devtools_url(self) -> str:
        assert self._process is not None and self._process.stderr is not None
        seen = []
        for line in self._process.stderr:
            if line.startswith(LISTENING):
                threading.Thread(target=_drain, args=(self._process.stderr,), name="chromium-stderr",
                                 daemon=True).start()
                return line[len(LISTENING):].strip()
            seen.append(line)
        raise RuntimeError("chromium exited before its DevTools endpoint was up:\n" + "".join(seen[-20:]))

    async def _read(self) -> None:
        assert self._socket is not None
        async for message in self._socket:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            payload = json.loads(message.data)
            if "id" in payload:
                future = self._waiting.pop(payload["id"], None)
                if future is not None and not future.done():
                    future.set_result(payload)
            else:
                self._event(payload["method"], payload.get("params", {}))
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(RuntimeError("the DevTools connection closed"))

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.problems.console.append(" ".join(str(a.get("value", a.get("description", "")))
                                                  for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.problems.exceptions.append(details.get("exception", {}).get("description") or details.get("text", ""))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.problems.log.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())

    async def send(self, method: str, params: dict[str, Any] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
        assert self._socket is not None
        message_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[message_id] = future
        await self._socket.send_str(json.dumps({"id": message_id, "method": method, "params": params or {}}))
        reply = await asyncio.wait_for(future, timeout_s)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def open(self, url: str) -> None:
        await self.send("Page.navigate", {"url": url})

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression (awaited if it is a promise)."""
        result = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                      "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_until(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Evaluate ``expression`` until it is truthy; its value. Each evaluation is a round trip to the page, so
        this waits on the page's own progress, not a guessed time."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"the page never satisfied {expression!r}; problems: {self.problems.all()}")
            await self.evaluate("new Promise((done) => requestAnimationFrame(() => setTimeout(done, 50)))")

    async def screenshot(self, path: Path, full_page: bool = True) -> None:
        if full_page:
            metrics = await self.send("Page.getLayoutMetrics")
            height = int(metrics["cssContentSize"]["height"])
            await self.send("Emulation.setDeviceMetricsOverride",
                            {"width": self.width, "height": max(height, 200), "deviceScaleFactor": 1,
                             "mobile": False})
            await self.evaluate("new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
        shot = await self.send("Page.captureScreenshot", {"format": "png"})
        path.write_bytes(base64.b64decode(shot["data"]))


def _drain(stream: Any) -> None:
    """Read chromium's stderr to its end, so a chatty browser never blocks on a full pipe."""
    try:
        for _ in stream:
            pass
    except (OSError, ValueError):  # closed under the reader: the browser is gone
        pass
