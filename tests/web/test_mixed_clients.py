"""64 streams at once against one live server with the embedded model, from clients that behave differently: each
kind ends as it should, the well-behaved ones are served within a bound, and afterwards the engine holds nothing
(no running request, KV block, seat or state slot) and the server no connection.

A new kind of client is one more `Behaviour` in BEHAVIOURS: how it talks to the server and what it must see."""
from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from tests.web.server_utils import LiveServer
from tests.web.stalled_clients import closed_by_server, send_and_stall, wait_released
from web.app import ServerSettings

WRITE_TIMEOUT_S = 0.5
SERVED_WITHIN_S = 30.0  # a normal client's whole answer, beside the others, on a loaded CPU
CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Tell me about rivers."}], "stream": True,
        "ignore_eos": True}


@dataclass(slots=True)
class Behaviour:
    name: str
    count: int
    run: Callable[[aiohttp.ClientSession, str], Awaitable[Any]]  # one client's visit; what it saw
    check: Callable[[Any], Awaitable[None]]  # once the server is idle again: raises when what it saw is wrong


async def normal(session: aiohttp.ClientSession, url: str) -> tuple[float, bytes]:
    started = time.monotonic()
    async with session.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 8}) as response:
        assert response.status == 200
        return time.monotonic() - started, await response.read()


async def check_normal(seen: tuple[float, bytes]) -> None:
    took, raw = seen
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and took < SERVED_WITHIN_S
    assert orjson.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


async def stalled(session: aiohttp.ClientSession, url: str) -> socket.socket:
    """Sends a request and never reads (20 alternatives a token fill the small buffers within a few tokens); the
    socket stays open, so only the server can have ended the connection by the time the server is idle."""
    return await send_and_stall(url, "/v1/chat/completions",
                                {**CHAT, "max_tokens": 2000, "logprobs": True, "top_logprobs": 20})


async def check_stalled(sock: socket.socket) -> None:
    try:
        assert await closed_by_server(sock, 5.0), "a client that stopped reading was never cut"
    finally:
        sock.close()


async def disconnects(session: aiohttp.ClientSession, url: str) -> bytes:
    async with session.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2000}) as response:
        assert response.status == 200
        first = await response.content.readline()
        response.close()  # mid-stream
        return first


async def check_disconnects(first: bytes) -> None:
    assert first.startswith(b"data: {")


def tool_with(properties: int) -> dict:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
    return {"type": "function", "function": {"name": "f", "description": "d", "parameters": schema}}


async def forced_tool(session: aiohttp.ClientSession, url: str, properties: int) -> tuple[int, dict]:
    body = {**CHAT, "max_tokens": 8, "tools": [tool_with(properties)], "tool_choice": "required"}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        return response.status, await response.json()


async def huge_schema(session: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    return await forced_tool(session, url, 5000)  # ~120 KB of schema, over MAX_GRAMMAR_BYTES


async def check_huge_schema(seen: tuple[int, dict]) -> None:
    status, body = seen
    assert status == 400 and "--max-grammar-bytes" in body["error"]["message"]


async def slow_schema(session: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    return await forced_tool(session, url, 600)  # optional properties: compiles for over MAX_GRAMMAR_SECONDS


async def check_slow_schema(seen: tuple[int, dict]) -> None:
    status, body = seen
    assert status == 400 and "--max-grammar-seconds" in body["error"]["message"]


MAX_GRAMMAR_BYTES = 64 << 10
MAX_GRAMMAR_SECONDS = 0.2
BEHAVIOURS = [
    Behaviour("normal", 22, normal, check_normal),
    Behaviour("stalled reader", 18, stalled, check_stalled),
    Behaviour("disconnects mid-stream", 18, disconnects, check_disconnects),
    Behaviour("huge tool schema", 4, huge_schema, check_huge_schema),
    Behaviour("slow-compiling tool schema", 2, slow_schema, check_slow_schema),
]


def test_64_streams_of_mixed_clients_end_well_and_free_everything(smollm_gguf_path):
    settings = ServerSettings(served_model_names=["smol"], write_timeout_s=WRITE_TIMEOUT_S, send_buffer_bytes=4096)
    # one compute thread: on a shared CPU a second one waits for a core more than it computes
    with LiveServer(smollm_gguf_path, settings, block_size=16, num_kv_blocks=2048, max_num_seqs=64,
                    max_num_batched_tokens=512, cpu_threads=1, max_grammar_bytes=MAX_GRAMMAR_BYTES,
                    max_grammar_seconds=MAX_GRAMMAR_SECONDS) as live:
        async def main() -> None:
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                visits = [[kind.run(session, live.url) for _ in range(kind.count)] for kind in BEHAVIOURS]
                seen = await asyncio.gather(*(asyncio.gather(*group) for group in visits))
            await asyncio.to_thread(wait_released, live, SERVED_WITHIN_S)  # stalled sockets are still open here
            for kind, outcomes in zip(BEHAVIOURS, seen):
                await asyncio.gather(*(kind.check(outcome) for outcome in outcomes))

        asyncio.run(main())
    assert sum(kind.count for kind in BEHAVIOURS) == 64
