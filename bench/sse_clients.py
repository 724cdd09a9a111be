"""The HTTP clients of bench/host_overhead.py --http, run as their own process (as real clients are:
their reading is not the server's host time). Imports nothing of the project, so it starts fast.

    python bench/sse_clients.py URL BATCH TOKENS POLL_MS NICE [--grammar]

prints [first-byte times, end, CPU seconds while reading] as JSON (perf_counter: the server's clock).
"""
from __future__ import annotations

import json
import os
import selectors
import socket
import sys
import time

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
          "items": {"type": "string"}}}, "required": ["name", "tags"]}


def http_clients(url: str, batch: int, tokens: int, grammar: bool, poll_ms: float,
                 nice: int = 0) -> tuple[list[float], float, float]:
    """`batch` streaming requests over raw sockets, read until each chunked body ends. Lean on purpose
    (no SSE parsing): the clients share this machine's 2 cores with the server, and what is measured is
    the server's host time. poll_ms > 0 reads every poll_ms instead of blocking in select: a client that
    sleeps in select is woken by each server write, and on a VM that wakeup (an inter-processor
    interrupt) is paid inside the server's send call, a cost a remote client never puts on the server.
    nice > 0 lowers the clients' CPU priority: on 2 cores their reads otherwise take turns with the
    server's threads, which remote clients never do."""
    if nice > 0:
        os.nice(nice)
    body = {"model": "m", "prompt": "hello", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "repetition_detection": False}
    if grammar:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    payload = json.dumps(body).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: conveyor\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
    selector = selectors.DefaultSelector()
    sockets = []
    for _ in range(batch):  # connect everything first, then send the requests back to back
        if url.startswith("unix:"):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(url.removeprefix("unix:"))
        else:
            host, port = url.removeprefix("http://").split(":")
            sock = socket.create_connection((host, int(port)))
        sockets.append(sock)
    for i, sock in enumerate(sockets):
        sock.sendall(request)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, i)
    firsts: list[float | None] = [None] * batch
    heads, tails = [b""] * batch, [b""] * batch
    open_streams = batch
    buffer = bytearray(1 << 16)  # one read buffer, as real clients have (a fresh 1 MiB per recv costs an mmap)
    view = memoryview(buffer)
    cpu = time.process_time()
    while open_streams:
        if poll_ms > 0:
            time.sleep(poll_ms / 1e3)
        for key, _ in selector.select(timeout=0 if poll_ms > 0 else None):
            i, size = key.data, key.fileobj.recv_into(buffer)  # type: ignore[union-attr]
            data = bytes(view[:size])
            if firsts[i] is None:
                firsts[i], heads[i] = time.perf_counter(), data[:12]
            tails[i] = (tails[i] + data)[-5:]
            if not data or tails[i] == b"0\r\n\r\n":
                selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
                open_streams -= 1
    end, cpu = time.perf_counter(), time.process_time() - cpu
    failed = [h for h in heads if not h.startswith(b"HTTP/1.1 200")]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]!r}")
    return [f for f in firsts if f is not None], end, cpu


if __name__ == "__main__":
    url, batch, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    poll_ms, nice = float(sys.argv[4]), int(sys.argv[5])
    print(json.dumps(http_clients(url, batch, tokens, "--grammar" in sys.argv[6:], poll_ms, nice)))
