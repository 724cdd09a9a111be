"""Streamed response bytes go to the client sockets from one thread beside the event loop.

At batch 256 the kernel's send path (TCP loopback or a Unix socket, waking each reading client)
costs the event loop about as much per decode step as the whole engine does. So the loop only
formats each SSE event and hands its bytes over; the sender thread writes everything handed over
since its last round in one call that releases the GIL (ext/socket_send), and that kernel work runs
on another core while the loop goes on with the next step.

- Order and loss: a stream's bytes reach its socket in the order written, and none is dropped while
  the client reads. A client that reads slower than the engine writes gets several events per send.
- A client that stops reading is failed alone once its unsent bytes pass its cap: its handler's
  next write raises ConnectionResetError, which cancels the request.
- Descriptors: the sender writes through its own duplicate of the connection's descriptor, which
  only the sender thread closes, after the stream's last send. The event loop closing the
  connection therefore never makes the sender write into a reused descriptor.
"""
from __future__ import annotations

import asyncio
import os
import select
import socket
import sys
import threading
from typing import Any

import ext

_CLOSE, _DROP, _STOP = "close", "drop", "stop"
# A stream's loop-side state and its per-delta write (compiled with the sends: ext/socket_send)
SenderStream = ext.load("socket_send").SenderStream
_STREAM_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)


def lower_thread_priority(niceness: int) -> bool:
    """Add `niceness` to the calling thread's nice value (at most 19); True if it was changed. Linux
    only: there a thread is a task with its own nice value, elsewhere the call would name a process."""
    if niceness <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
    except OSError:
        return False
    return True


class SocketSender:
    def __init__(self, cap_bytes: int = 16 << 20, niceness: int = 0) -> None:
        """niceness > 0 lowers the sender thread's CPU priority, so that on a host with few cores its
        sends yield to the device thread's launches and the event loop (the step's critical path)."""
        self.cap_bytes = cap_bytes
        self.niceness = niceness
        self._open: set[SenderStream] = set()  # loop thread: opened and not released yet
        module = ext.load("socket_send")
        self._stream_type, self._write_queue_type = module.SenderStream, module.WriteQueue
        self._take_handed, self._send_round = module.take_handed, module.send_round
        self._lock = threading.Lock()
        self._handed: list[tuple[SenderStream | None, bytes, str | None]] = []  # under _lock
        self._woken = False  # under _lock: a wake byte is in the pipe
        self._writes: Any = None  # loop thread: the streams to hand over (a WriteQueue, made by start())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake_read = self._wake_write = -1
        # sender thread only
        self._poller = select.poll()
        self._held: dict[int, SenderStream] = {}  # fd -> stream the sender holds
        self._blocked: set[int] = set()  # fds waiting for their socket to take more (POLLOUT)
        self._sendable: dict[int, SenderStream] = {}  # fds with unsent bytes to try this round

    # ---- loop thread -----------------------------------------------------------------------------

    @property
    def open_streams(self) -> int:
        return len(self._open)

    def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._writes = self._write_queue_type(lambda: loop.call_soon(self._hand_off))
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._poller.register(self._wake_read, select.POLLIN)
        self._thread = threading.Thread(target=self._run, name="conveyor-sender", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Ends the thread; streams still open are released (their unsent bytes dropped) and fail."""
        if self._thread is None:
            return
        self._hand_off()  # what was written in this iteration goes first
        self._hand_over([(None, b"", _STOP)])
        thread, self._thread = self._thread, None
        self._writes.stopped = True
        await asyncio.to_thread(thread.join)
        for stream in list(self._open):  # the thread released what it held; the rest it never saw
            if not stream.gone:
                stream.gone = True
                stream.error = stream.error or "the server stopped"
                os.close(stream.fd)
            self._released(stream)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def open(self, transport: Any, cap_bytes: int | None = None) -> SenderStream | None:
        """Takes over writing to the transport's socket, or None where it cannot: not running, TLS,
        not a stream socket, or bytes still queued in the transport (their order must hold).
        cap_bytes: this stream's limit of unsent bytes (default: the sender's)."""
        if self._thread is None or transport is None or transport.is_closing():
            return None
        sock = transport.get_extra_info("socket")
        if sock is None or transport.get_extra_info("sslcontext") is not None:
            return None
        if sock.family not in _STREAM_FAMILIES or sock.type != socket.SOCK_STREAM:
            return None
        if transport.get_write_buffer_size():
            return None
        fd = os.dup(sock.fileno())
        os.set_blocking(fd, False)
        assert self._loop is not None
        stream = self._stream_type(fd, self._loop.create_future(), self.cap_bytes if cap_bytes is None else cap_bytes,
                                   self._writes)
        self._open.add(stream)
        return stream

    def write(self, stream: SenderStream, data: bytes) -> None:
        """Queue bytes for the stream's socket; raises ConnectionResetError once the stream failed or the
        sender stopped. (Per delta, callers may use `stream.write` itself: see SSEBody.chunk_writer.)"""
        stream.write(data)

    async def close(self, stream: SenderStream) -> None:
        """Returns once every byte written was taken by the kernel and the descriptor released;
        raises ConnectionResetError if the stream failed."""
        if stream.ending is None:
            stream.ending = _CLOSE
            self._writes.queue(stream)
        await asyncio.shield(stream.released)
        if stream.error is not None:
            raise ConnectionResetError(stream.error)

    def drop(self, stream: SenderStream) -> None:
        """Gives the stream up: bytes not yet sent are discarded and the descriptor released."""
        if stream.ending != _DROP and not stream.released.done():
            stream.pending.clear()
            stream.ending = _DROP
            self._writes.queue(stream)

    def _hand_off(self) -> None:
        """One hand-over per loop iteration, after every handler woken in it has written."""
        writes = self._writes
        writes.scheduled = False
        items: list[tuple[SenderStream | None, bytes, str | None]] = []
        for stream in writes.streams:
            items.append((stream, b"".join(stream.pending), stream.ending))
            stream.pending.clear()
            stream.queued = False
        writes.streams.clear()
        if items and self._thread is not None:
            self._hand_over(items)

    def _hand_over(self, items: list[tuple[SenderStream | None, bytes, str | None]]) -> None:
        with self._lock:
            self._handed.extend(items)
            wake, self._woken = not self._woken, True
        if wake:
            os.write(self._wake_write, b"\0")

    def _released(self, stream: SenderStream) -> None:
        self._open.discard(stream)
        if not stream.released.done():
            stream.released.set_result(None)

    # ---- sender thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        lower_thread_priority(self.niceness)
        while True:
            for fd, _ in self._poller.poll():
                if fd != self._wake_read:  # the socket takes more (or failed: the send says how)
                    self._poller.unregister(fd)
                    self._blocked.discard(fd)
                    self._sendable[fd] = self._held[fd]
            self._drain_wake_pipe()  # before taking the items: a hand-over after the take wakes us again
            with self._lock:
                items, self._handed, self._woken = self._handed, [], False
            if not self._take_handed(items, self._held, self._sendable, self._blocked, self._release, self._fail):
                for held in list(self._held.values()):  # the stop item
                    held.error = held.error or "the server stopped"
                    self._release(held)
                return
            if self._sendable:
                self._send_round(self._sendable, self._blocked, self._block, self._release, self._fail)

    def _block(self, fd: int) -> None:
        """The socket took less than it was given: send to it again once it takes more (POLLOUT)."""
        self._poller.register(fd, select.POLLOUT)

    def _fail(self, stream: SenderStream, reason: str) -> None:
        stream.error = reason
        self._release(stream)

    def _release(self, stream: SenderStream) -> None:
        self._held.pop(stream.fd, None)
        self._sendable.pop(stream.fd, None)
        if stream.fd in self._blocked:
            self._blocked.discard(stream.fd)
            self._poller.unregister(stream.fd)
        stream.unsent = b""
        stream.gone = True
        os.close(stream.fd)
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._released, stream)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
