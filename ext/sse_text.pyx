# cython: language_level=3, boundscheck=False, wraparound=False
"""Per-token SSE text events and HTTP chunk framing, compiled: one scan and one allocation per token
instead of orjson.dumps plus %-formatting (run batch-size times per decode step on the event loop).
Twin: ext/sse_text_py.py (byte-identical results; tests/ext/test_sse_text.py)."""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_Clear, PyErr_ExceptionMatches
from libc.string cimport memcpy


cdef extern from "Python.h":
    # Declared here without `except NULL` so that a lone surrogate's UnicodeEncodeError can become
    # a TypeError (what orjson raises) without a try block on the fast path.
    const char *PyUnicode_AsUTF8AndSize(object text, Py_ssize_t *size)


cdef const char *HEX = b"0123456789abcdef"
# ESCAPED[c]: bytes orjson writes for the UTF-8 byte c (1: itself; 2: a short escape; 6: \u00XX).
# Bytes >= 0x80 are copied as they are (orjson writes non-ASCII as raw UTF-8).
cdef unsigned char ESCAPED[256]
# SHORT[c]: the letter after the backslash of a two-byte escape.
cdef char SHORT[128]


cdef void _init_tables():
    cdef int c
    for c in range(256):
        ESCAPED[c] = 6 if c < 0x20 else 1
    for c in range(128):
        SHORT[c] = 0
    for c, letter in ((0x08, b"b"), (0x09, b"t"), (0x0a, b"n"), (0x0c, b"f"), (0x0d, b"r"),
                      (0x22, b'"'), (0x5c, b"\\")):
        ESCAPED[c] = 2
        SHORT[c] = letter[0]


_init_tables()


cdef inline const char *_utf8(str text, Py_ssize_t *size) except NULL:
    """The str's UTF-8 (its own buffer for compact ASCII, else CPython's cached copy); TypeError for
    a lone surrogate, which has no UTF-8."""
    cdef const char *s = PyUnicode_AsUTF8AndSize(text, size)
    if s == NULL:
        if PyErr_ExceptionMatches(UnicodeEncodeError):
            PyErr_Clear()
            raise TypeError("str is not valid UTF-8: surrogates not allowed")
        return NULL  # MemoryError, already set
    return s


cdef inline Py_ssize_t _escaped_size(const unsigned char *s, Py_ssize_t n) noexcept:
    cdef Py_ssize_t i, total = 0
    for i in range(n):
        total += ESCAPED[s[i]]
    return total


cdef inline char *_write_json_string(char *out, const unsigned char *s, Py_ssize_t n,
                                     Py_ssize_t escaped) noexcept:
    """Writes "s" JSON-escaped (escaped: its escaped size, from _escaped_size); returns the end."""
    cdef Py_ssize_t i
    cdef unsigned char c, k
    out[0] = b'"'
    out += 1
    if escaped == n:  # nothing to escape: the common case
        memcpy(out, s, n)
        out += n
    else:
        for i in range(n):
            c = s[i]
            k = ESCAPED[c]
            if k == 1:
                out[0] = <char>c
                out += 1
            elif k == 2:
                out[0] = b'\\'
                out[1] = SHORT[c]
                out += 2
            else:
                memcpy(out, b"\\u00", 4)
                out[4] = HEX[c >> 4]
                out[5] = HEX[c & 15]
                out += 6
    out[0] = b'"'
    return out + 1


cdef inline int _hex_digits(Py_ssize_t n) noexcept:
    cdef int digits = 1
    while n >= 16:
        n >>= 4
        digits += 1
    return digits


cdef inline void _write_header(char *out, Py_ssize_t n, int digits) noexcept:
    """Writes n in `digits` lowercase hex digits, then CRLF."""
    cdef int i
    for i in range(digits - 1, -1, -1):
        out[i] = HEX[n & 15]
        n >>= 4
    out[digits] = b'\r'
    out[digits + 1] = b'\n'


cdef inline char *_write_event(char *out, bytes before, const unsigned char *s, Py_ssize_t n,
                               Py_ssize_t escaped, bytes after) noexcept:
    """Writes before + the JSON string of s + after; returns the end."""
    cdef Py_ssize_t nb = PyBytes_GET_SIZE(before), na = PyBytes_GET_SIZE(after)
    memcpy(out, PyBytes_AS_STRING(before), nb)
    out = _write_json_string(out + nb, s, n, escaped)
    memcpy(out, PyBytes_AS_STRING(after), na)
    return out + na


def text_event(bytes before not None, str text not None, bytes after not None) -> bytes:
    """before + orjson.dumps(text) + after."""
    cdef Py_ssize_t n
    cdef const unsigned char *s = <const unsigned char *>_utf8(text, &n)
    cdef Py_ssize_t escaped = _escaped_size(s, n)
    cdef bytes result = PyBytes_FromStringAndSize(NULL, PyBytes_GET_SIZE(before) + escaped + 2 + PyBytes_GET_SIZE(after))
    _write_event(PyBytes_AS_STRING(result), before, s, n, escaped, after)
    return result


def http_chunk(bytes data not None) -> bytes:
    """One HTTP/1.1 chunk: b"%x\\r\\n%b\\r\\n" % (len(data), data)."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    if n == 0:
        raise ValueError("an empty chunk ends the body")
    cdef int digits = _hex_digits(n)
    cdef bytes result = PyBytes_FromStringAndSize(NULL, digits + 2 + n + 2)
    cdef char *out = PyBytes_AS_STRING(result)
    _write_header(out, n, digits)
    memcpy(out + digits + 2, PyBytes_AS_STRING(data), n)
    memcpy(out + digits + 2 + n, b"\r\n", 2)
    return result


def text_event_chunk(bytes before not None, str text not None, bytes after not None) -> bytes:
    """http_chunk(text_event(before, text, after)), in one allocation."""
    cdef Py_ssize_t n
    cdef const unsigned char *s = <const unsigned char *>_utf8(text, &n)
    cdef Py_ssize_t escaped = _escaped_size(s, n)
    cdef Py_ssize_t size = PyBytes_GET_SIZE(before) + escaped + 2 + PyBytes_GET_SIZE(after)  # never 0: the quotes
    cdef int digits = _hex_digits(size)
    cdef bytes result = PyBytes_FromStringAndSize(NULL, digits + 2 + size + 2)
    cdef char *out = PyBytes_AS_STRING(result)
    _write_header(out, size, digits)
    out = _write_event(out + digits + 2, before, s, n, escaped, after)
    memcpy(out, b"\r\n", 2)
    return result
