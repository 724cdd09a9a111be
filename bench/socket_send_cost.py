"""What one small send costs this machine's kernel, over loopback TCP (TCP_NODELAY, as the server's
connections) and a Unix socket pair: the floor under the socket sender's CPU per step in
bench/host_overhead.py --http (256 sends per step at batch 256). Hosts differ here by ~4x, more than
anything the server's own code changes, so host-overhead results are read beside this figure.

    python bench/socket_send_cost.py [--sockets 256] [--bytes 60] [--out FILE]

The sends go out as the sender's do (ext/socket_send.send_all, one batch per round); the peers read
only between rounds, so no send pays for waking a reader.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ext  # noqa: E402
from bench.report import emit_json  # noqa: E402


def socket_pairs(kind: str, count: int) -> list[tuple[socket.socket, socket.socket]]:
    """(server side, client side) pairs; the server side is what the sender writes to."""
    if kind == "unix":
        return [socket.socketpair() for _ in range(count)]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(count)
        pairs = []
        for _ in range(count):
            client = socket.create_connection(listener.getsockname())
            server, _ = listener.accept()
            server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pairs.append((server, client))
        return pairs


def drain(client: socket.socket) -> None:
    client.setblocking(False)
    try:
        while client.recv(1 << 16):
            pass
    except BlockingIOError:
        pass


def us_per_send(kind: str, sockets: int, size: int, rounds: int, sends_per_round: int) -> list[float]:
    send_all = ext.load("socket_send").send_all
    pairs = socket_pairs(kind, sockets)
    fds, buffers = [server.fileno() for server, _ in pairs], [b"x" * size] * sockets
    timings = []
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(sends_per_round):
                send_all(fds, buffers)
            timings.append((time.perf_counter() - start) / (sends_per_round * sockets) * 1e6)
            for _, client in pairs:
                drain(client)
    finally:
        for server, client in pairs:
            server.close()
            client.close()
    return timings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sockets", type=int, default=256)
    parser.add_argument("--bytes", type=int, default=60, help="one send's size (a token's SSE chunk is ~60-90)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    results = {}
    for kind in ("tcp", "unix"):
        runs = us_per_send(kind, a.sockets, a.bytes, a.rounds, sends_per_round=20)
        results[kind] = {"us_per_send_median": round(statistics.median(runs), 3),
                         "us_per_send_runs": [round(run, 3) for run in runs]}
    emit_json({"benchmark": "socket_send_cost", "date": time.strftime("%Y-%m-%d"),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}",
               "compiled_sender": ext.is_compiled("socket_send"), "sockets": a.sockets, "bytes": a.bytes,
               "results": results}, a.out)


if __name__ == "__main__":
    main()
