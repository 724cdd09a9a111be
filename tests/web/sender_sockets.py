"""Real sockets for the sender tests: event-loop transports on one end, plain sockets the test reads
on the other, and descriptor accounting."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
from collections.abc import Awaitable
from typing import Any, TypeVar

import pytest


T = TypeVar("T")
GUARD_S = 5  # a missing byte or release fails the test instead of hanging it
SMALL_BUFFER = 4096  # the kernel raises it to its minimum: far below what the tests write
KINDS = [pytest.param("unix", id="unix"), pytest.param("tcp", id="tcp")]


class Connection(asyncio.Protocol):
    """The event loop's side of a connection: tells when the loop let go of its descriptor."""

    def __init__(self) -> None:
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


class Sockets:
    """Connections whose server end is an event-loop transport (as the web server has) and whose client
    end is a plain socket the test reads; everything is closed at the end."""

    def __init__(self) -> None:
        self.opened: list[tuple[Any, Connection, socket.socket]] = []
        self.readers: list[asyncio.Future[bytes]] = []

    def read_exactly(self, client: socket.socket, size: int) -> asyncio.Future[bytes]:
        """A client reading concurrently (as a task), ended with the test whatever happened."""
        reader = asyncio.ensure_future(read_exactly(client, size))
        self.readers.append(reader)
        return reader

    async def connect(self, kind: str = "unix", small: bool = False) -> tuple[Any, Connection, socket.socket]:
        if kind == "unix":
            server, client = socket.socketpair()
        else:
            with socket.create_server(("127.0.0.1", 0)) as listener:
                client = socket.create_connection(listener.getsockname())
                server, _ = listener.accept()
            # a TCP reader as small as the writer crawls (window probes); 64 KiB does not
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        if small:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
        client.setblocking(False)
        transport, protocol = await asyncio.get_running_loop().create_connection(Connection, sock=server)
        self.opened.append((transport, protocol, client))
        return transport, protocol, client

    async def open_stream(self, sender: Any, kind: str = "unix") -> tuple[Any, socket.socket, str]:
        """A connection handed to `sender`: its stream, the client socket, and the socket's id (holders)."""
        transport, _, client = await self.connect(kind)
        stream = sender.open(transport)
        assert stream is not None
        return stream, client, socket_id(transport)

    async def close_all(self) -> None:
        for reader in self.readers:
            reader.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)
        for transport, protocol, client in self.opened:
            transport.abort()
            client.close()
            await within(protocol.lost)


async def within(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, GUARD_S)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def socket_id(transport: Any) -> str:
    """What /proc/self/fd links to for the transport's socket (shared by every dup of it)."""
    return f"socket:[{os.fstat(transport.get_extra_info('socket').fileno()).st_ino}]"


def holders(*sockets: str) -> int:
    """How many of this process's descriptors refer to these sockets."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}") in sockets
        except FileNotFoundError:  # the listing's own descriptor
            pass
    return count


def chunks(stream_id: int, count: int, size: int = 100) -> list[bytes]:
    """Distinct random chunks: any loss, duplication or misordering shows up in the comparison."""
    rng = random.Random(stream_id)
    return [rng.randbytes(rng.randint(1, 2 * size)) for _ in range(count)]


async def read_exactly(client: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    parts, got = [], 0
    while got < size:
        part = await within(loop.sock_recv(client, min(size - got, 1 << 16)))
        assert part, f"EOF after {got} of {size} bytes"
        parts.append(part)
        got += len(part)
    return b"".join(parts)


async def read_to_eof(client: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    parts = []
    while part := await within(loop.sock_recv(client, 1 << 16)):
        parts.append(part)
    return b"".join(parts)


def read_available(client: socket.socket) -> bytes:
    """What a non-blocking client can read now (the socket stays open)."""
    parts = []
    while True:
        try:
            part = client.recv(1 << 20)
        except BlockingIOError:
            return b"".join(parts)
        assert part, "EOF"
        parts.append(part)


def read_nothing_yet(client: socket.socket) -> bool:
    """True when the socket is open with nothing to read (not at EOF)."""
    try:
        client.recv(1)
    except BlockingIOError:
        return True
    return False


def read_slowly(client: socket.socket, size: int, start: threading.Event) -> bytes:
    """A client thread that waits for `start`, then reads in small pieces."""
    assert start.wait(GUARD_S)
    client.settimeout(GUARD_S)
    parts, got = [], 0
    while got < size:
        part = client.recv(min(size - got, 1000))
        assert part, f"EOF after {got} of {size} bytes"
        parts.append(part)
        got += len(part)
    return b"".join(parts)
