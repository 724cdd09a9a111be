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
