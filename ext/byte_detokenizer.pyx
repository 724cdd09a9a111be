# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The byte-table detokenizer (see pipeline/detokenizer_bytes.py), compiled: push_one runs once per
generated token per sequence on the event loop. Twin: ext/byte_detokenizer_py.py (same results for
every call; tests/ext/test_byte_detokenizer.py proves it).

Equality with Python's incremental UTF-8 decoder holds by construction: that decoder is
`codecs.utf_8_decode(held + new, "replace", final)`, i.e. the C calls used here on the same bytes,
keeping the unconsumed tail (an incomplete character, at most 3 bytes) as the held bytes. With
nothing held, a token whose bytes decode completely always gives the same text, so that text is
kept per tokenizer and reused: the common token costs a lookup, no decode and no new string.
"""
cimport cython
from cpython.ref cimport PyObject
from libc.limits cimport LLONG_MAX, LLONG_MIN
from libc.string cimport memcpy


cdef extern from "Python.h":
    # Borrowed-pointer forms: no reference counting on the per-token path.
    PyObject *PyTuple_GET_ITEM(object tup, Py_ssize_t index)
    PyObject *PyList_GET_ITEM(object lst, Py_ssize_t index)
    char *PyBytes_AS_STRING(PyObject *b)
    Py_ssize_t PyBytes_GET_SIZE(PyObject *b)
    bint PyBytes_Check(PyObject *b)
    bint PyLong_Check(object o)
    long long PyLong_AsLongLongAndOverflow(object o, int *overflow) except? -1
    object PyNumber_Index(object o)
    bytes PyBytes_FromStringAndSize(const char *s, Py_ssize_t n)
    str PyUnicode_DecodeUTF8(const char *s, Py_ssize_t n, const char *errors)
    str PyUnicode_DecodeUTF8Stateful(const char *s, Py_ssize_t n, const char *errors, Py_ssize_t *consumed)


cdef enum:
    STACK_BYTES = 256  # held bytes + a token's bytes up to this size are joined on the stack
cdef dict _TEXTS = {}  # id(token_bytes) -> (token_bytes, texts): shared by every sequence of a tokenizer


cdef tuple _shared(object table):
    """(token_bytes, texts) for a table. token_bytes is checked to hold only bytes once per table, not
    per sequence (49k items). texts[id] is filled on first use with the id's text when its bytes decode
    completely on their own (nothing held before or after); lazily, so no sequence pays for the whole vocabulary."""
    cdef tuple token_bytes = tuple(table.token_bytes)
    cdef Py_ssize_t i
    cached = _TEXTS.get(id(token_bytes))
    if cached is not None and (<tuple>cached)[0] is token_bytes:
        return <tuple>cached
    for i in range(len(token_bytes)):
        if not PyBytes_Check(PyTuple_GET_ITEM(token_bytes, i)):
            raise TypeError(f"token_bytes[{i}] is not bytes")
    if len(_TEXTS) > 64:
        _TEXTS.clear()
    cached = _TEXTS[id(token_bytes)] = (token_bytes, [None] * len(token_bytes))
    return <tuple>cached


@cython.final
cdef class ByteLevelDetokenizer:
    """Same contract as IncrementalDetokenizer: the joined deltas plus flush() equal
    `backend.decode(output_ids, skip_special_tokens=...)` for any chunking of the ids."""

    cdef tuple _token_bytes
    cdef list _texts  # shared: id -> its text when decoded with nothing held, or None (not known yet / holds bytes)
    cdef Py_ssize_t _size
    cdef frozenset _dropped
    cdef dict _added_text
    cdef long long _lo, _hi  # every dropped or added id lies in [_lo, _hi]: others skip both lookups
    cdef list _pieces
    cdef bint _finished
    cdef unsigned char _held[4]  # an incomplete UTF-8 character
    cdef Py_ssize_t _n_held

    def __init__(self, table, skip_special_tokens: bool = True) -> None:
        self._pieces = []
        self._finished = False
        self._n_held = 0
        self._token_bytes, self._texts = _shared(table)
        self._size = len(self._token_bytes)
        self._dropped = frozenset(table.special_ids) if skip_special_tokens else frozenset()
        self._added_text = {i: t for i, t in table.added_text.items() if i not in self._dropped}
        self._lo, self._hi = LLONG_MAX, LLONG_MIN
        cdef int overflow
        cdef long long v
        for key in (*self._dropped, *self._added_text):
            if not PyLong_Check(key):  # an odd key may equal any id: look every id up
                self._lo, self._hi = LLONG_MIN, LLONG_MAX
                break
            overflow = 0
            v = PyLong_AsLongLongAndOverflow(key, &overflow)
            if not overflow:  # ids past long long always take the lookups
                self._lo, self._hi = min(self._lo, v), max(self._hi, v)

    @property
    def text(self) -> str:
        """All text emitted so far (the pieces collapse into one, so repeated reads stay cheap)."""
        joined = "".join(self._pieces)
        self._pieces = [joined]
        return joined

    def push(self, token_ids) -> str:
        return "".join([self._push(int(token_id)) for token_id in token_ids])

    def push_one(self, token_id) -> str:
        """One id (the decode step's case): a lookup of its known text, else one incremental UTF-8 decode."""
        return self._push(token_id)

    def flush(self) -> str:
        """End of sequence: an incomplete character left over decodes as U+FFFD, as in the full decode."""
        if self._finished:
            return ""
        self._finished = True
        return self._emit(self._final_decode())

    cdef str _push(self, object token_id):
        cdef int overflow = 0
        cdef long long v
        cdef PyObject *token
        cdef PyObject *known
        cdef Py_ssize_t was_held
        if self._finished:
            raise RuntimeError("push() after flush(): the sequence has ended")
        if not PyLong_Check(token_id):
            token_id = PyNumber_Index(token_id)
        v = PyLong_AsLongLongAndOverflow(token_id, &overflow)
        if overflow or self._lo <= v <= self._hi:
            if token_id in self._dropped:
                return ""
            added = self._added_text.get(token_id)
            if added is not None:  # an added token ends the byte run: what is held decodes as is
                return self._emit(self._final_decode() + added if self._n_held else added)
        if overflow or v < 0 or v >= self._size:
            return ""  # no bytes: the held ones stay held
        if self._n_held == 0:
            known = PyList_GET_ITEM(self._texts, <Py_ssize_t>v)
            if known != <PyObject *>None:
                return self._emit(<str>known)
        token = PyTuple_GET_ITEM(self._token_bytes, <Py_ssize_t>v)
        was_held = self._n_held
        text = self._decode(PyBytes_AS_STRING(token), PyBytes_GET_SIZE(token))
        if was_held == 0 and self._n_held == 0:  # a complete decode of the bytes alone: remember it
            self._texts[<Py_ssize_t>v] = text
        return self._emit(text)

    cdef str _decode(self, const char *new, Py_ssize_t n):
        """Held bytes + new, decoded as far as they go; the incomplete tail becomes the held bytes."""
        cdef char stack[STACK_BYTES]
        cdef const char *buf = new
        cdef Py_ssize_t total = self._n_held + n, consumed = 0
        cdef bytes joined
        if n == 0:
            return ""
        if self._n_held:
            if total <= STACK_BYTES:
                buf = stack
            else:
                joined = PyBytes_FromStringAndSize(NULL, total)
                buf = PyBytes_AS_STRING(<PyObject *>joined)
            memcpy(<char *>buf, self._held, self._n_held)
            memcpy(<char *>buf + self._n_held, new, n)
        text = PyUnicode_DecodeUTF8Stateful(buf, total, "replace", &consumed)
        if total - consumed > 4:
            raise SystemError("the UTF-8 decoder held back more than one character")
        self._n_held = total - consumed
        memcpy(self._held, buf + consumed, self._n_held)
        return text

    cdef str _final_decode(self):
        """The held bytes decoded as the end of a run (U+FFFD for an incomplete character)."""
        if self._n_held == 0:
            return ""
        text = PyUnicode_DecodeUTF8(<const char *>self._held, self._n_held, "replace")
        self._n_held = 0
        return text

    cdef inline str _emit(self, str delta):
        if delta:
            self._pieces.append(delta)
        return delta
