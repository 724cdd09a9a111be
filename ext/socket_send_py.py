"""Pure-Python twin of ext/socket_send.pyx: sending a batch of buffers to their sockets.

The compiled one releases the GIL once for the whole batch; this one releases it around each send.
"""
from __future__ import annotations

import errno
import socket


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
