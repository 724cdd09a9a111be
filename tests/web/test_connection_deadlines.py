"""Every connection has a deadline (web/connections.py): a client that stops reading is cut and its request freed,
--request-timeout ends the connection too, slow or oversized request heads and slow bodies are refused."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from tests.web.server_utils import LiveServer
from tests.web.stalled_clients import closed_by_server, connect, post_bytes, send_and_stall, trickle, wait_released
from web.app import ServerSettings

# Each event carries 20 alternatives a token, so a few tokens fill the small socket buffers (send_buffer_bytes).
# One compute thread everywhere: on a shared CPU a second one waits for a core more than it computes.
STALLING_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 900,
                 "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}


def settings(**fields) -> ServerSettings:
    return ServerSettings(served_model_names=["tiny"], **fields)


def test_streams_whose_clients_stop_reading_are_cut_and_free_everything(tiny_model_dir):
    with LiveServer(tiny_model_dir, settings(write_timeout_s=0.5, send_buffer_bytes=4096), cpu_threads=1) as live:
        async def main():
            socks = await asyncio.gather(*[send_and_stall(live.url, "/v1/chat/completions", STALLING_CHAT)
                                           for _ in range(20)])
            took = await asyncio.to_thread(wait_released, live, 20.0)  # the sockets are still open, unread
            closed = await asyncio.gather(*[closed_by_server(s, 5.0) for s in socks])
            for sock in socks:
                sock.close()
            return took, closed

        took, closed = asyncio.run(main())
    assert all(closed), closed
    assert took < 15.0  # 900 tokens each would take far longer: they were cut, not finished


def test_request_timeout_ends_a_stalled_stream_and_its_connection(tiny_model_dir):
    with LiveServer(tiny_model_dir, settings(request_timeout_s=0.3, write_timeout_s=1.0, send_buffer_bytes=4096),
                    cpu_threads=1) as live:
        async def main():
            sock = await send_and_stall(live.url, "/v1/chat/completions", STALLING_CHAT)
            took = await asyncio.to_thread(wait_released, live, 10.0)
            closed = await closed_by_server(sock, 5.0)
            sock.close()
            return took, closed

        took, closed = asyncio.run(main())
    assert closed and took < 0.3 + 1.0 + 3.0  # the timeout, the write deadline of its error event, slack


@pytest.fixture(scope="module")
def strict_server(tiny_model_dir):
    with LiveServer(tiny_model_dir, settings(header_timeout_s=0.5, body_timeout_s=0.5, max_header_bytes=4096),
                    cpu_threads=1) as live:
        yield live


def test_a_request_head_sent_a_byte_at_a_time_is_cut_at_the_header_timeout(strict_server):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n" + b"X-Slow: " + b"a" * 200

    async def main():
        sock = await connect(strict_server.url)
        try:
            return await trickle(sock, head, every_s=0.05, timeout_s=8.0)
        finally:
            sock.close()

    closed_after = asyncio.run(main())
    assert closed_after is not None and closed_after < 0.5 + 2.0


async def fetch(url: str, method: str = "GET", **kwargs) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, **kwargs) as response:
            return response.status, response.headers.get("Content-Type", ""), await response.read()


def api_error(status: int, content_type: str, raw: bytes) -> dict:
    assert content_type.startswith("application/json"), (status, content_type, raw[:200])
    error = orjson.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]
    return error


@pytest.mark.parametrize("headers", [{"X-Big": "a" * (64 << 10)}, {f"X-Many-{i}": "1" for i in range(200)}],
                         ids=["a 64 KB header", "200 headers"])
def test_request_heads_over_the_limits_are_431_in_the_api_shape(strict_server, headers):
    status, content_type, raw = asyncio.run(fetch(strict_server.url + "/health", headers=headers))
    error = api_error(status, content_type, raw)
    assert status == 431 and error["code"] == "request_header_fields_too_large"
    assert strict_server.get_json("/health") == {"status": "ok"}


def test_a_malformed_request_head_is_400_in_the_api_shape(strict_server):
    async def main():
        sock = await connect(strict_server.url, rcvbuf=1 << 16)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, b"GET /health HTTP/1.1\r\nHost: test\r\nBad Header\r\n\r\n")
        raw = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 5.0):
            raw += chunk
        sock.close()
        return raw

    raw = asyncio.run(main())
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400" and b"application/json" in head
    assert orjson.loads(body)["error"]["type"] == "invalid_request_error"


def test_a_body_that_does_not_arrive_is_408(strict_server):
    async def main():
        sock = await connect(strict_server.url, rcvbuf=1 << 16)
        loop = asyncio.get_running_loop()
        whole = post_bytes("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        await loop.sock_sendall(sock, whole[:-5])  # the head and all but the body's last bytes
        started = time.monotonic()
        raw = b""
        while not raw.endswith(b"}}"):  # the answer; the server then reads (and drops) what is left, for a while
            raw += await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 5.0)
        sock.close()
        return raw, time.monotonic() - started

    raw, took = asyncio.run(main())
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"408" and orjson.loads(body)["error"]["code"] == "request_timeout"
    assert took < 0.5 + 2.0
