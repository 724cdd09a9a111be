"""The sender thread on real sockets: order and completeness per stream, slow and stuck readers,
closed peers, drop/stop, and descriptors (its own dups, released exactly once, never leaked)."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
from collections.abc import Awaitable
from typing import Any, TypeVar

import pytest

import ext
from tests.conftest import run_async
from web.socket_sender import SocketSender

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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pure", [pytest.param(True, id="twin"), pytest.param(False, id="compiled")])
def test_many_streams_arrive_complete_and_in_order(kind: str, pure: bool, monkeypatch) -> None:
    """Interleaved writes on many streams, several per loop iteration: each client reads exactly its own
    bytes in order, close returns once all were sent, and every dup is closed."""
    if pure:
        monkeypatch.setenv("CONVEYOR_PURE_PYTHON", "1")
    elif not ext.is_compiled("socket_send"):
        pytest.skip("ext/socket_send not built")

    async def main() -> tuple[list[bytes], list[bytes], tuple[int, int], int, int]:
        sockets, sender = Sockets(), SocketSender()
        sender.start()
        try:
            connections = [await sockets.connect(kind) for _ in range(8)]
            ids = [socket_id(transport) for transport, _, _ in connections]
            streams = [sender.open(transport) for transport, _, _ in connections]
            assert all(stream is not None for stream in streams)
            opened, held = sender.open_streams, holders(*ids)
            data = [chunks(i, 200) for i in range(len(streams))]
            expected = [b"".join(parts) for parts in data]
            readers = [sockets.read_exactly(client, len(whole))
                       for (_, _, client), whole in zip(connections, expected)]
            cursors = [0] * len(streams)
            for round_ in range(1000):
                if cursors == [len(parts) for parts in data]:
                    break
                for i, (stream, parts) in enumerate(zip(streams, data)):
                    take = (i + round_) % 4  # 0 to 3 writes per stream in one loop iteration
                    for chunk in parts[cursors[i]:cursors[i] + take]:
                        sender.write(stream, chunk)
                    cursors[i] = min(cursors[i] + take, len(parts))
                await asyncio.sleep(0)
            await within(asyncio.gather(*(sender.close(stream) for stream in streams)))
            received = await within(asyncio.gather(*readers))
            return received, expected, (opened, held), sender.open_streams, holders(*ids)
        finally:
            await sender.stop()
            await sockets.close_all()

    received, expected, opened, open_after, held_after = run_async(main())
    assert opened == (8, 16)  # each socket: the transport's descriptor and the sender's dup
    assert received == expected
    assert open_after == 0
    assert held_after == 8


@pytest.mark.parametrize("kind", KINDS)
def test_a_slow_reader_gets_everything_in_order(kind: str) -> None:
    """Far more than the socket holds, read in small pieces by a client thread that starts late: the
    sender waits for room (POLLOUT) instead of losing or reordering bytes."""

    async def main() -> tuple[bytes, bytes, int]:
        loop = asyncio.get_running_loop()
        sockets, sender, start = Sockets(), SocketSender(), threading.Event()
        sender.start()
        try:
            transport, _, client = await sockets.connect(kind, small=True)
            stream = sender.open(transport)
            assert stream is not None
            data = chunks(1, 2000, size=1000)  # about 2 MB, far below cap_bytes
            expected = b"".join(data)
            reader = loop.run_in_executor(None, read_slowly, client, len(expected), start)
            for i, chunk in enumerate(data):
                sender.write(stream, chunk)
                if i == len(data) // 4:
                    start.set()
                await asyncio.sleep(0)
            start.set()
            await within(sender.close(stream))
            return await within(reader), expected, sender.open_streams
        finally:
            start.set()
            await sender.stop()
            await sockets.close_all()

    received, expected, open_after = run_async(main())
    assert len(received) == len(expected)
    assert received == expected
    assert open_after == 0


def test_a_client_that_stops_reading_fails_alone() -> None:
    """Past cap_bytes unsent, the stuck stream is failed and released; a stream beside it is untouched.
    What the stuck client got is an in-order prefix."""
    cap = 256 << 10  # above all the fine stream writes: it cannot fail however late the thread runs

    async def main() -> dict[str, Any]:
        sockets, sender = Sockets(), SocketSender(cap_bytes=cap)
        sender.start()
        try:
            (stuck_transport, _, stuck_client), (fine_transport, _, fine_client) = \
                [await sockets.connect("unix") for _ in range(2)]
            ids = socket_id(stuck_transport), socket_id(fine_transport)
            stuck, fine = sender.open(stuck_transport), sender.open(fine_transport)
            assert stuck is not None and fine is not None
            stuck_data, fine_data = chunks(1, 1001, size=8000), chunks(2, 1000)  # about 8 MB stuck
            fine_expected = b"".join(fine_data)
            sender.write(stuck, stuck_data[0])  # the stuck client reads this much, then stops
            first = await read_exactly(stuck_client, len(stuck_data[0]))
            fine_reader = sockets.read_exactly(fine_client, len(fine_expected))
            written = len(first)
            for stuck_chunk, fine_chunk in zip(stuck_data[1:], fine_data):
                sender.write(fine, fine_chunk)
                if not stuck.released.done():
                    try:
                        sender.write(stuck, stuck_chunk)
                        written += len(stuck_chunk)
                    except ConnectionResetError:
                        pass
                await asyncio.sleep(0)
            await within(asyncio.shield(stuck.released))
            with pytest.raises(ConnectionResetError) as on_write:
                sender.write(stuck, b"more")
            with pytest.raises(ConnectionResetError):
                await within(sender.close(stuck))
            open_while_fine_open = sender.open_streams
            await within(sender.close(fine))
            result = {
                "written": written, "stuck_prefix": first + read_available(stuck_client),
                "stuck": b"".join(stuck_data),
                "error": str(on_write.value), "open_while_fine_open": open_while_fine_open,
                "fine": await within(fine_reader), "fine_expected": fine_expected,
                "open_after": sender.open_streams, "held_after": holders(*ids),
            }
            return result
        finally:
            await sender.stop()
            await sockets.close_all()

    result = run_async(main())
    assert "stopped reading" in result["error"]
    assert result["written"] > cap
    prefix = result["stuck_prefix"]
    assert len(prefix) < result["written"] and result["stuck"].startswith(prefix)
    assert result["open_while_fine_open"] == 1
    assert result["fine"] == result["fine_expected"]
    assert result["open_after"] == 0
    assert result["held_after"] == 2  # the transports'


def test_a_write_larger_than_the_cap_reaches_a_client_that_reads() -> None:
    """The cap is for clients that stopped reading; this one reads, and its socket could take it all."""

    async def main() -> bytes:
        sockets, sender = Sockets(), SocketSender(cap_bytes=64 << 10)
        sender.start()
        try:
            transport, _, client = await sockets.connect("unix")  # default buffer: room for 100 kB
            stream = sender.open(transport)
            assert stream is not None
            data = random.Random(1).randbytes(100_000)
            reader = sockets.read_exactly(client, len(data))
            sender.write(stream, data)
            await within(sender.close(stream))
            assert await within(reader) == data
            return data
        finally:
            await sender.stop()
            await sockets.close_all()

    run_async(main())


@pytest.mark.parametrize("kind", KINDS)
def test_a_closed_client_fails_the_stream_on_a_later_write(kind: str) -> None:
    """The client hangs up mid-stream: writing on fails the stream (a Unix socket at the first send, TCP
    once the client's reset came back), then write and close raise ConnectionResetError; nothing leaks."""

    async def main() -> tuple[bytes, bytes, int, int, int]:
        sockets, sender = Sockets(), SocketSender()
        sender.start()
        try:
            transport, _, client = await sockets.connect(kind)
            own = socket_id(transport)
            stream = sender.open(transport)
            assert stream is not None
            first = b"".join(chunks(1, 50))
            sender.write(stream, first)
            received = await read_exactly(client, len(first))
            client.close()
            writes = 0
            for chunk in chunks(2, 250):  # each round waits (briefly) on a real send and reset
                try:
                    sender.write(stream, chunk)
                except ConnectionResetError:
                    break
                writes += 1
                await asyncio.wait([stream.released], timeout=0.02)
            with pytest.raises(ConnectionResetError):
                sender.write(stream, b"x")
            with pytest.raises(ConnectionResetError):
                await within(sender.close(stream))
            sender.drop(stream)  # harmless on a failed stream
            # the loop's transport may have closed itself on the client's EOF: only the dup must be gone
            return received, first, writes, sender.open_streams, holders(own) - (not transport.is_closing())
        finally:
            await sender.stop()
            await sockets.close_all()

    received, first, writes, open_after, dups_left = run_async(main())
    assert received == first
    assert writes >= 1 and (kind != "unix" or writes == 1)
    assert open_after == 0
    assert dups_left == 0


def test_close_raises_when_the_client_hung_up_before_the_last_bytes() -> None:
    """close() is where a handler learns that its final bytes never left."""

    async def main() -> tuple[int, int]:
        sockets, sender = Sockets(), SocketSender()
        sender.start()
        try:
            transport, _, client = await sockets.connect("unix")
            stream = sender.open(transport)
            assert stream is not None
            client.close()
            sender.write(stream, b"final bytes")
            with pytest.raises(ConnectionResetError) as info:
                await within(sender.close(stream))
            assert "connection failed" in str(info.value)
            return sender.open_streams, int(stream.released.done())
        finally:
            await sender.stop()
            await sockets.close_all()

    assert run_async(main()) == (0, 1)


def test_drop_discards_unsent_bytes_and_releases_the_descriptor() -> None:
    """A dropped stream sends nothing more; the client sees EOF once the loop closed its side too, which
    shows that the sender's dup was closed. Dropping again, or closing after, changes nothing."""

    async def main() -> dict[str, Any]:
        sockets, sender = Sockets(), SocketSender()
        sender.start()
        try:
            transport, protocol, client = await sockets.connect("unix", small=True)
            own = socket_id(transport)
            stream = sender.open(transport)
            assert stream is not None
            data = chunks(1, 500, size=4000)  # about 2 MB to a client that reads the first chunk only
            sender.write(stream, data[0])
            await read_exactly(client, len(data[0]))
            for chunk in data[1:]:
                sender.write(stream, chunk)
                await asyncio.sleep(0)
            sender.drop(stream)
            with pytest.raises(RuntimeError):
                sender.write(stream, b"after drop")
            await within(asyncio.shield(stream.released))
            sender.drop(stream)
            await within(sender.close(stream))  # returns: a dropped stream did not fail
            result = {"open_after": sender.open_streams, "held_after": holders(own)}
            transport.close()
            await within(protocol.lost)
            result["received"], result["sent"] = data[0] + await read_to_eof(client), b"".join(data)
            return result
        finally:
            await sender.stop()
            await sockets.close_all()

    result = run_async(main())
    assert len(result["received"]) < len(result["sent"])
    assert result["sent"].startswith(result["received"])
    assert result["open_after"] == 0
    assert result["held_after"] == 1  # the transport's


def test_drop_before_the_hand_over_sends_nothing_and_drop_after_close_is_harmless() -> None:
    async def main() -> dict[str, Any]:
        sockets, sender = Sockets(), SocketSender()
        sender.start()
        try:
            (dropped_transport, _, dropped_client), (closed_transport, _, closed_client) = \
                [await sockets.connect("unix") for _ in range(2)]
            ids = socket_id(dropped_transport), socket_id(closed_transport)
            dropped, closed = sender.open(dropped_transport), sender.open(closed_transport)
            assert dropped is not None and closed is not None
            sender.write(dropped, b"never sent")
            sender.drop(dropped)  # same loop iteration: the bytes were not handed over yet
            sender.drop(dropped)
            sender.write(closed, b"all of it")
            await within(sender.close(closed))
            sender.drop(closed)
            await within(sender.close(closed))
            await within(asyncio.shield(dropped.released))
            return {"dropped_nothing": read_nothing_yet(dropped_client),
                    "closed": await read_exactly(closed_client, 9), "closed_then": read_nothing_yet(closed_client),
                    "open_after": sender.open_streams, "held_after": holders(*ids)}
        finally:
            await sender.stop()
            await sockets.close_all()

    assert run_async(main()) == {"dropped_nothing": True, "closed": b"all of it", "closed_then": True,
                                 "open_after": 0, "held_after": 2}


def test_open_refuses_what_it_cannot_take_over() -> None:
    """None (and no dup) where the sender cannot write in order: not started, stopped, bytes still queued
    in the transport, a closing transport, a datagram socket."""

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        sockets, sender = Sockets(), SocketSender()
        result: dict[str, Any] = {}
        try:
            transport, _, _ = await sockets.connect("unix")
            result["not_started"] = sender.open(transport)
            sender.start()
            busy, _, _ = await sockets.connect("unix", small=True)
            busy.write(b"\0" * (4 << 20))  # the client does not read: the transport keeps most of it
            result["buffered"] = busy.get_write_buffer_size() > 0
            result["busy"] = sender.open(busy)
            closing, _, _ = await sockets.connect("unix")
            closing.close()
            result["closing"] = sender.open(closing)
            server, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            datagram, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, sock=server)
            try:
                result["datagram"] = sender.open(datagram)
            finally:
                datagram.close()
                client.close()
            result["open_streams"], result["busy_held"] = sender.open_streams, holders(socket_id(busy))
            await sender.stop()
            result["stopped"] = sender.open(transport)
            return result
        finally:
            await sender.stop()
            await sockets.close_all()

    result = run_async(main())
    assert result == {"not_started": None, "buffered": True, "busy": None, "closing": None, "datagram": None,
                      "open_streams": 0, "busy_held": 1, "stopped": None}


def test_stop_releases_streams_still_open_and_ends_the_thread() -> None:
    """A flowing stream and a stuck one (bytes unsent): stop releases both (failed: neither was closed),
    closes their dups and the wake pipe, and the thread is gone."""

    async def main() -> dict[str, Any]:
        sockets, sender = Sockets(), SocketSender()
        try:
            (flowing_transport, _, flowing_client), (stuck_transport, _, _) = \
                [await sockets.connect("unix", small=True) for _ in range(2)]
            ids = socket_id(flowing_transport), socket_id(stuck_transport)
            before = fd_count()
            sender.start()
            thread = sender._thread
            assert thread is not None and thread.is_alive()
            flowing, stuck = sender.open(flowing_transport), sender.open(stuck_transport)
            assert flowing is not None and stuck is not None
            sender.write(flowing, b"hello")
            for chunk in chunks(1, 100, size=10_000):
                sender.write(stuck, chunk)
            await asyncio.sleep(0)  # handed over before the stop
            await read_exactly(flowing_client, 5)  # the thread holds `flowing`
            await within(sender.stop())
            return {"released": [flowing.released.done(), stuck.released.done()],
                    "errors": [flowing.error, stuck.error], "alive": thread.is_alive(),
                    "open_after": sender.open_streams, "held_after": holders(*ids),
                    "leaked_fds": fd_count() - before}  # the dups and the wake pipe
        finally:
            await sender.stop()
            await sockets.close_all()

    assert run_async(main()) == {"released": [True, True], "errors": ["the server stopped"] * 2, "alive": False,
                                 "open_after": 0, "held_after": 2, "leaked_fds": 0}


@pytest.mark.parametrize("written", [pytest.param(False, id="never-written"),
                                     pytest.param(True, id="written-in-the-same-iteration")])
def test_stop_releases_streams_not_handed_over_yet(written: bool) -> None:
    """stop() promises that streams still open are released, including ones the thread never saw."""

    async def main() -> tuple[bool, int, int]:
        sockets, sender = Sockets(), SocketSender()
        stream = None
        try:
            transport, _, _ = await sockets.connect("unix")
            sender.start()
            stream = sender.open(transport)
            assert stream is not None
            if written:
                sender.write(stream, b"hello")
            await sender.stop()  # called directly: wait_for's task would let the hand-over run first
            return stream.released.done(), sender.open_streams, holders(socket_id(transport))
        finally:
            await sender.stop()
            if stream is not None and not stream.released.done():
                os.close(stream.fd)  # the leaked dup: do not let it outlive the test
            await sockets.close_all()

    assert run_async(main()) == (True, 0, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_the_loop_closing_its_transport_does_not_break_the_stream(kind: str) -> None:
    """The sender writes through its own dup: after the loop closed the connection, later bytes still
    arrive, the socket stays open while the sender holds it, and the client sees EOF once it let go."""

    async def main() -> dict[str, Any]:
        sockets, sender = Sockets(), SocketSender()
        sender.start()
        try:
            transport, protocol, client = await sockets.connect(kind, small=True)
            own = socket_id(transport)
            stream = sender.open(transport)
            assert stream is not None
            first, second = b"".join(chunks(1, 20)), b"".join(chunks(2, 2000, size=500))  # second: about 1 MB
            sender.write(stream, first)
            transport.close()
            await within(protocol.lost)
            result: dict[str, Any] = {"held_by_sender": holders(own),
                                      "first": await read_exactly(client, len(first)) == first}
            reader = sockets.read_exactly(client, len(second))
            for i in range(0, len(second), 10_000):
                sender.write(stream, second[i:i + 10_000])
                await asyncio.sleep(0)
            result["second"] = await within(reader) == second
            result["open_while_held"] = read_nothing_yet(client)
            await within(sender.close(stream))
            result["eof_after_close"] = await read_to_eof(client) == b""
            result["open_after"], result["held_after"] = sender.open_streams, holders(own)
            return result
        finally:
            await sender.stop()
            await sockets.close_all()

    assert run_async(main()) == {"held_by_sender": 1, "first": True, "second": True, "open_while_held": True,
                                 "eof_after_close": True, "open_after": 0, "held_after": 0}
