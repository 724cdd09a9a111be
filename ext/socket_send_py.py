"""Pure-Python twin of ext/socket_send.pyx: sending a batch of buffers to their sockets, and the loop
thread's side of a sender stream (its writes, queued for one hand-over per loop iteration).

The compiled send_all releases the GIL once for the whole batch; this one releases it around each send.
"""
from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from typing import Any


def send_all(fds: list[int], buffers: list[bytes]) -> list[int]:
    """results[i]: how many bytes of buffers[i] the kernel took (fewer once fds[i]'s send buffer is
    full: the caller keeps the rest), or -errno when the socket failed (EPIPE, ECONNRESET, EBADF)."""
    if len(buffers) != len(fds):
        raise ValueError("one buffer per socket")
    if not all(isinstance(buffer, bytes) for buffer in buffers):
        raise TypeError("buffers must be bytes")
    flags = socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT
    results = []
    for fd, buffer in zip(fds, buffers):
        if not -(1 << 31) <= fd < 1 << 31:
            raise OverflowError(f"file descriptor {fd} does not fit a C int")
        if fd < 0:
            results.append(-errno.EBADF)
            continue
        done = 0
        view = memoryview(buffer)
        while done < len(buffer):
            try:
                done += _send(fd, view[done:], flags)
            except InterruptedError:
                continue
            except BlockingIOError:
                break
            except OSError as error:
                done = -(error.errno or 0)
                break
        results.append(done)
    return results


def _send(fd: int, data: memoryview, flags: int) -> int:
    """send(2) on a bare descriptor; the socket object only borrows it (detached, so never closed)."""
    sock = socket.socket(fileno=fd)
    try:
        return sock.send(data, flags)
    finally:
        sock.detach()


class WriteQueue:
    """The loop thread's streams written to in this loop iteration, handed over once at its end."""

    __slots__ = ("streams", "scheduled", "stopped", "schedule")

    def __init__(self, schedule: Callable[[], Any]) -> None:
        """schedule(): arrange one hand-over at the end of this loop iteration."""
        self.streams: list[SenderStream] = []
        self.scheduled = False  # the hand-over is scheduled on the loop
        self.stopped = False  # the sender stopped: writes fail
        self.schedule = schedule

    def queue(self, stream: SenderStream) -> None:
        if not stream.queued:
            stream.queued = True
            self.streams.append(stream)
        if not self.scheduled:
            self.scheduled = True
            self.schedule()


class SenderStream:
    """One response's socket as the sender holds it. `write` runs per streamed delta (256 per step at
    batch 256): the compiled one is a single C call."""

    __slots__ = ("fd", "released", "cap_bytes", "writes", "pending", "queued", "ending", "unsent", "closing",
                 "gone", "error")

    def __init__(self, fd: int, released: Any, cap_bytes: int, writes: WriteQueue) -> None:
        self.fd = fd  # the sender's own duplicate of the connection's descriptor
        self.released = released  # resolved on the loop once the sender let go of `fd`
        self.cap_bytes = cap_bytes  # unsent bytes past which the client is taken to have stopped reading
        self.writes = writes
        self.pending: list[bytes] = []  # loop thread: written, not handed over yet
        self.queued = False  # loop thread: in the next hand-over
        self.ending: str | None = None  # loop thread: close or drop was asked
        self.unsent = b""  # sender thread: handed over, not yet taken by the kernel
        self.closing = False  # sender thread: release once `unsent` is empty
        self.gone = False  # sender thread: `fd` was closed
        self.error: str | None = None  # why the stream failed (set by the sender thread, before release)

    def write(self, data: bytes) -> None:
        """Queue bytes for the socket (loop thread); raises ConnectionResetError once the stream failed
        or the sender stopped."""
        if not isinstance(data, bytes):
            raise TypeError("data must be bytes")
        if self.error is not None:
            raise ConnectionResetError(self.error)
        if self.writes.stopped:
            raise ConnectionResetError("the server stopped")
        if self.ending is not None:
            raise RuntimeError("write to a closed sender stream")
        self.pending.append(data)
        if not self.queued:
            self.writes.queue(self)


def take_handed(items: list[tuple[SenderStream | None, bytes, str | None]], held: dict[int, SenderStream],
                sendable: dict[int, SenderStream], blocked: set[int], release: Callable[[SenderStream], None],
                fail: Callable[[SenderStream, str], None]) -> bool:
    """The sender thread's intake of one hand-over: (stream, bytes, ending) items, ending None, "close"
    or "drop". The stream's bytes join its unsent ones; it is sendable this round unless its socket is
    blocked (then past its cap it fails: fail(stream, reason)); a drop, or a close with nothing unsent,
    releases it (release(stream)). Returns False at the stop item (stream None): nothing after it is
    taken."""
    for stream, data, ending in items:
        if stream is None:
            return False
        if stream.gone:
            continue
        held[stream.fd] = stream
        if data:
            stream.unsent = stream.unsent + data if stream.unsent else data
            if stream.fd not in blocked:
                sendable[stream.fd] = stream
        if ending == "drop":
            release(stream)
        elif stream.fd in blocked and len(stream.unsent) > stream.cap_bytes:  # the socket refused more
            fail(stream, f"the client stopped reading ({len(stream.unsent)} bytes unsent)")
        elif ending == "close":
            stream.closing = True
            if not stream.unsent:
                release(stream)
    return True


def send_round(sendable: dict[int, SenderStream], blocked: set[int], block: Callable[[int], None],
               release: Callable[[SenderStream], None], fail: Callable[[SenderStream, str], None]) -> None:
    """Send every sendable stream's unsent bytes in one send_all (emptying `sendable`), then settle
    each: a failed socket fails its stream, bytes the kernel did not take stay unsent and block the
    socket (block(fd): wait until it takes more), a closing stream with nothing left is released."""
    streams = list(sendable.values())
    sendable.clear()
    results = send_all([stream.fd for stream in streams], [stream.unsent for stream in streams])
    for stream, sent in zip(streams, results):
        if sent < 0:
            fail(stream, f"the client connection failed: {os.strerror(-sent)}")
            continue
        stream.unsent = stream.unsent[sent:] if sent < len(stream.unsent) else b""
        if stream.unsent:
            blocked.add(stream.fd)
            block(stream.fd)
        elif stream.closing:
            release(stream)
