"""Clients that misbehave at the socket level, for the connection-deadline tests: raw sockets with a small receive
buffer that send a request and never read (so the server's writes really block), or that send their headers a
byte at a time."""
from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import orjson

SMALL_RCVBUF = 4096  # set before connecting: the window the server may fill stays this small


async def connect(url: str, rcvbuf: int = SMALL_RCVBUF) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    return sock


def post_bytes(path: str, body: dict[str, Any]) -> bytes:
    payload = orjson.dumps(body)
    head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


async def send_and_stall(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Send one request and read nothing: the caller keeps the socket (closing it would be a disconnect)."""
    sock = await connect(url)
    await asyncio.get_running_loop().sock_sendall(sock, post_bytes(path, body))
    return sock


async def closed_by_server(sock: socket.socket, timeout_s: float) -> bool:
    """Read what the server sent until it closes the connection (EOF or reset), within the timeout."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), deadline - time.monotonic())
            if not chunk:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


async def trickle(sock: socket.socket, data: bytes, every_s: float, timeout_s: float) -> float | None:
    """Send data a byte every `every_s` seconds; the seconds until the server closed the connection (None: it
    did not within the timeout)."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    for byte in data:
        try:
            await loop.sock_sendall(sock, bytes([byte]))
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), every_s)
            if not chunk:
                return time.monotonic() - started
        except TimeoutError:
            pass  # nothing from the server yet: send the next byte
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            return None
    return None


def released(live: Any) -> dict[str, Any]:
    """What a live server still holds for requests: all zero once every request ended and freed its sequences."""
    stats = live.get_json("/debug/stages")
    return {"running": stats["running"], "prefilling": stats["prefilling"], "kv_blocks": stats["kv_blocks"]["used"],
            "seats": stats["seats"]["held"], "state_slots": stats["state_slots_used"],
            "waiting": stats["waiting"]["requests"], "requests": live.engine.num_requests}


def open_connections(live: Any) -> int:
    """Connections the live server holds (the poll's own, to /debug/stages, has ended by then)."""
    return len(live.runner.server.connections)


def wait_released(live: Any, timeout_s: float, connections: int = 0) -> float:
    """Poll until the server holds nothing for requests and at most `connections` connections; the seconds it took."""
    started = time.monotonic()
    while True:
        held = open_connections(live)  # before this poll's own request opens one
        holding = released(live)
        if not any(holding.values()) and held <= connections:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"still held after {timeout_s}s: {holding}, {held} connection(s)")
        time.sleep(0.02)
