"""The sender thread on real sockets: every stream's bytes arrive complete and in order (many streams,
slow readers, the loop closing its transport), what open refuses, and stop releasing everything."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import sys
import threading
from typing import Any

import pytest

import ext
from tests.conftest import run_async
from tests.web.sender_sockets import (KINDS, chunks, fd_count, holders, read_exactly, read_nothing_yet, read_slowly,
                                     read_to_eof, socket_id, Sockets, within)
from web.socket_sender import SocketSender, lower_thread_priority


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


def _in_thread(function: Any) -> Any:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(function()))
    thread.start()
    thread.join()
    return result[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_lower_thread_priority_changes_only_the_calling_thread() -> None:
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def lowered(niceness: int) -> tuple[bool, int]:
        changed = lower_thread_priority(niceness)
        return changed, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert _in_thread(lambda: lowered(3)) == (own < 19, min(19, own + 3))
    assert _in_thread(lambda: lowered(0)) == (False, own)
    assert _in_thread(lambda: lowered(100)) == (own < 19, 19)  # capped at the lowest priority
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # this thread is untouched


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("niceness", [0, 4])
def test_the_sender_thread_runs_at_its_niceness(niceness: int) -> None:
    async def main() -> tuple[int, int, bytes]:
        sockets, sender = Sockets(), SocketSender(niceness=niceness)
        sender.start()
        try:
            transport, _, client = await sockets.connect("tcp")
            stream = sender.open(transport)
            assert stream is not None
            sender.write(stream, b"hello")
            await within(sender.close(stream))  # the thread has run: its priority is set
            assert sender._thread is not None
            nice = os.getpriority(os.PRIO_PROCESS, sender._thread.native_id)  # type: ignore[arg-type]
            return nice, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), \
                await within(sockets.read_exactly(client, 5))
        finally:
            await sender.stop()
            await sockets.close_all()

    sender_nice, own, received = run_async(main())
    assert sender_nice == min(19, own + niceness)
    assert received == b"hello"
