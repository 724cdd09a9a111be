"""The sender thread when clients fail: a reader that stops is failed alone, a closed peer fails its
stream, and drop discards and releases; never a leaked descriptor."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import run_async
from tests.web.sender_sockets import (KINDS, chunks, holders, read_available, read_exactly, read_nothing_yet,
                                     read_to_eof, socket_id, Sockets, within)
from web.socket_sender import SocketSender


def test_a_client_that_stops_reading_fails_alone() -> None:
    """Past cap_bytes unsent, the stuck stream is failed and released; a stream beside it is untouched.
    What the stuck client got is an in-order prefix."""
    cap = 256 << 10  # above all the fine stream writes: it cannot fail however late the thread runs

    async def main() -> dict[str, Any]:
        sockets, sender = Sockets(), SocketSender(cap_bytes=cap)
        sender.start()
        try:
            (stuck, stuck_client, stuck_id), (fine, fine_client, fine_id) = \
                [await sockets.open_stream(sender) for _ in range(2)]
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
                "open_after": sender.open_streams, "held_after": holders(stuck_id, fine_id),
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
            (dropped, dropped_client, dropped_id), (closed, closed_client, closed_id) = \
                [await sockets.open_stream(sender) for _ in range(2)]
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
                    "open_after": sender.open_streams, "held_after": holders(dropped_id, closed_id)}
        finally:
            await sender.stop()
            await sockets.close_all()

    assert run_async(main()) == {"dropped_nothing": True, "closed": b"all of it", "closed_then": True,
                                 "open_after": 0, "held_after": 2}
