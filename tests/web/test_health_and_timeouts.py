"""/health while loading and when a device step hangs; --request-timeout ends requests cleanly."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
from aiohttp.test_utils import TestClient, TestServer

from tests.web.server_utils import LiveServer
from tests.web.stalled_clients import wait_released
from web.app import ServerSettings, ServerState, build_app
from web.metrics import ServerMetrics


def test_health_and_generation_answer_503_while_the_model_loads():
    async def main():
        state = ServerState(ServerSettings(served_model_names=["m"]), ServerMetrics(lambda: {}, "m"))
        async with TestClient(TestServer(build_app(state))) as client:
            health = await client.get("/health")
            chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            return health.status, await health.json(), chat.status, await chat.json(), health.headers

    status, body, chat_status, chat_body, headers = asyncio.run(main())
    assert status == 503 and body == {"status": "loading"} and "Retry-After" in headers
    assert chat_status == 503 and "loading" in chat_body["error"]["message"]


def test_health_fails_when_a_device_step_hangs(tiny_model_dir):
    with LiveServer(tiny_model_dir, wedged_step_s=5.0) as live:
        assert live.get_json("/health") == {"status": "ok"}
        executor = live.engine.executor
        executor._launching_since = time.monotonic() - 60  # as if the current launch had run for a minute
        try:
            status, body = fetch_health(live.url)
        finally:
            executor._launching_since = None
    assert status == 503 and "device step" in body["status"]


def fetch_health(url: str) -> tuple[int, dict]:
    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as response:
                return response.status, await response.json()

    return asyncio.run(main())


def test_request_timeout_ends_requests_with_a_clear_error(tiny_model_dir):
    settings = ServerSettings(served_model_names=["tiny"], request_timeout_s=0.5)
    with LiveServer(tiny_model_dir, settings) as live:
        async def main():
            body = {"model": "tiny", "prompt": "x", "max_tokens": 900, "ignore_eos": True}
            async with aiohttp.ClientSession() as session:
                async with session.post(live.url + "/v1/completions", json=body) as response:
                    plain = response.status, await response.json(), response.headers.get("Connection")
                async with session.post(live.url + "/v1/completions", json={**body, "stream": True}) as response:
                    streamed = response.status, await response.read()
                # the session would reuse its connections: the server closed them, the streamed one too (well
                # before the 10 s an idle kept-alive connection is given)
                await asyncio.to_thread(wait_released, live, 3.0)
            return plain, streamed

        (status, payload, connection), (stream_status, raw) = asyncio.run(main())
        live.wait_idle()
    assert status == 504 and "timed out" in payload["error"]["message"]
    assert connection == "close"  # a timed-out client may not be reading: its connection is not kept alive
    events = [e for e in raw.split(b"\n\n") if e]
    assert stream_status == 200 and events[-1] == b"data: [DONE]"
    assert "timed out" in orjson.loads(events[-2][6:])["error"]["message"]
