# cython: language_level=3, boundscheck=False, wraparound=False
"""Sending a batch of buffers to their sockets in one call that releases the GIL, compiled.
Twin: ext/socket_send_py.py (same results; tests/ext/test_socket_send.py)."""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdlib cimport free, malloc


cdef extern from "sys/socket.h" nogil:
    ssize_t send(int fd, const void *buf, size_t n, int flags)
    int MSG_NOSIGNAL
    int MSG_DONTWAIT


cdef extern from "errno.h" nogil:
    int EWOULDBLOCK


def send_all(list fds, list buffers):
    """results[i]: how many bytes of buffers[i] the kernel took (fewer once fds[i]'s send buffer is
    full: the caller keeps the rest), or -errno when the socket failed (EPIPE, ECONNRESET, EBADF)."""
    cdef Py_ssize_t n = len(fds), i
    if len(buffers) != n:
        raise ValueError("one buffer per socket")
    cdef tuple keep = tuple(buffers)  # the bytes stay alive (and unchanged) while the GIL is released
    for buffer in keep:
        if not isinstance(buffer, bytes):
            raise TypeError("buffers must be bytes")
    cdef int *fd = <int *>malloc(max(n, 1) * sizeof(int))
    cdef const char **data = <const char **>malloc(max(n, 1) * sizeof(char *))
    cdef ssize_t *size = <ssize_t *>malloc(max(n, 1) * sizeof(ssize_t))
    cdef ssize_t *done = <ssize_t *>malloc(max(n, 1) * sizeof(ssize_t))
    cdef ssize_t sent
    if fd == NULL or data == NULL or size == NULL or done == NULL:
        free(fd); free(data); free(size); free(done)
        raise MemoryError()
    try:
        for i in range(n):
            fd[i] = fds[i]
            data[i] = PyBytes_AS_STRING(keep[i])
            size[i] = PyBytes_GET_SIZE(keep[i])
        with nogil:
            for i in range(n):
                done[i] = 0
                while done[i] < size[i]:
                    sent = send(fd[i], data[i] + done[i], size[i] - done[i], MSG_NOSIGNAL | MSG_DONTWAIT)
                    if sent > 0:
                        done[i] += sent
                    elif sent < 0 and errno == EINTR:
                        continue
                    elif sent < 0 and (errno == EAGAIN or errno == EWOULDBLOCK):
                        break
                    else:
                        done[i] = -errno if sent < 0 else done[i]
                        break
        return [done[i] for i in range(n)]
    finally:
        free(fd); free(data); free(size); free(done)


cdef class WriteQueue:
    """The loop thread's streams written to in this loop iteration, handed over once at its end."""
    cdef public list streams
    cdef public bint scheduled  # the hand-over is scheduled on the loop
    cdef public bint stopped  # the sender stopped: writes fail
    cdef object schedule

    def __init__(self, schedule):
        """schedule(): arrange one hand-over at the end of this loop iteration."""
        self.streams = []
        self.scheduled = False
        self.stopped = False
        self.schedule = schedule

    def queue(self, SenderStream stream not None):
        if not stream.queued:
            stream.queued = True
            self.streams.append(stream)
        if not self.scheduled:
            self.scheduled = True
            self.schedule()


cdef class SenderStream:
    """One response's socket as the sender holds it. `write` runs per streamed delta (256 per step at
    batch 256), so it is one C call."""
    cdef readonly int fd  # the sender's own duplicate of the connection's descriptor
    cdef readonly object released  # resolved on the loop once the sender let go of `fd`
    cdef readonly Py_ssize_t cap_bytes  # unsent bytes past which the client is taken to have stopped reading
    cdef readonly WriteQueue writes
    cdef public list pending  # loop thread: written, not handed over yet
    cdef public bint queued  # loop thread: in the next hand-over
    cdef public object ending  # loop thread: close or drop was asked (None, "close", "drop")
    cdef public bytes unsent  # sender thread: handed over, not yet taken by the kernel
    cdef public bint closing  # sender thread: release once `unsent` is empty
    cdef public bint gone  # sender thread: `fd` was closed
    cdef public object error  # why the stream failed (set by the sender thread, before release)

    def __init__(self, int fd, released, Py_ssize_t cap_bytes, WriteQueue writes not None):
        self.fd = fd
        self.released = released
        self.cap_bytes = cap_bytes
        self.writes = writes
        self.pending = []
        self.queued = False
        self.ending = None
        self.unsent = b""
        self.closing = False
        self.gone = False
        self.error = None

    def write(self, bytes data not None):
        """Queue bytes for the socket (loop thread); raises ConnectionResetError once the stream failed
        or the sender stopped."""
        if self.error is not None:
            raise ConnectionResetError(self.error)
        if self.writes.stopped:
            raise ConnectionResetError("the server stopped")
        if self.ending is not None:
            raise RuntimeError("write to a closed sender stream")
        self.pending.append(data)
        if not self.queued:
            self.writes.queue(self)


def take_handed(list items, dict held, dict sendable, set blocked, release, fail):
    """The sender thread's intake of one hand-over: (stream, bytes, ending) items, ending None, "close"
    or "drop". The stream's bytes join its unsent ones; it is sendable this round unless its socket is
    blocked (then past its cap it fails: fail(stream, reason)); a drop, or a close with nothing unsent,
    releases it (release(stream)). Returns False at the stop item (stream None): nothing after it is
    taken."""
    cdef SenderStream stream
    cdef bytes data
    for item in items:
        if item[0] is None:
            return False
        stream = item[0]
        if stream.gone:
            continue
        data = item[1]
        ending = item[2]
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


def send_round(dict sendable, set blocked, block, release, fail):
    """Send every sendable stream's unsent bytes in one send_all (emptying `sendable`), then settle
    each: a failed socket fails its stream, bytes the kernel did not take stay unsent and block the
    socket (block(fd): wait until it takes more), a closing stream with nothing left is released."""
    cdef list streams = list(sendable.values())
    sendable.clear()
    cdef SenderStream stream
    cdef list fds = [], buffers = []
    for stream in streams:
        fds.append(stream.fd)
        buffers.append(stream.unsent)
    cdef list results = send_all(fds, buffers)
    cdef Py_ssize_t i, sent
    for i in range(len(streams)):
        stream = streams[i]
        sent = results[i]
        if sent < 0:
            fail(stream, f"the client connection failed: {_strerror(-sent)}")
            continue
        stream.unsent = stream.unsent[sent:] if sent < len(stream.unsent) else b""
        if stream.unsent:
            blocked.add(stream.fd)
            block(stream.fd)
        elif stream.closing:
            release(stream)


def _strerror(int code):
    import os
    return os.strerror(code)
