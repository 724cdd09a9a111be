# cython: language_level=3, boundscheck=False, wraparound=False
"""A step's grammar bitmask on the host, compiled. Twin: ext/bitmask_py.py (it says what each function does and
why; equal results, tests/ext/test_bitmask.py)."""
from libc.math cimport INFINITY
from libc.stdint cimport int32_t, uint32_t

# Work (bitmask words) below which the GIL stays held: giving it up costs the device thread a wait to win it back
# from the event loop, longer than scanning a few rows.
NOGIL_WORDS = 1 << 18


cdef inline bint _refuses(const int32_t[:, ::1] bitmask, Py_ssize_t row, Py_ssize_t full,
                          uint32_t tail_bits) noexcept nogil:
    cdef Py_ssize_t w
    for w in range(full):
        if bitmask[row, w] != -1:
            return True
    return tail_bits != 0 and (<uint32_t>bitmask[row, full] & tail_bits) != tail_bits


def masking_rows(const int32_t[:, ::1] bitmask, Py_ssize_t count, Py_ssize_t vocab_size) -> list:
    if not 0 <= count <= bitmask.shape[0]:
        raise IndexError(f"{count} rows asked of a bitmask of {bitmask.shape[0]}")
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot hold {vocab_size} tokens")
    cdef Py_ssize_t full = vocab_size // 32, tail = vocab_size % 32, k
    cdef uint32_t tail_bits = ((<uint32_t>1 << tail) - 1) if tail else 0
    return [k for k in range(count) if _refuses(bitmask, k, full, tail_bits)]


cdef void _apply(float[:, ::1] logits, const int32_t[:, ::1] bitmask, const int32_t[::1] rows,
                 const int32_t[::1] slots) noexcept nogil:
    cdef Py_ssize_t i, w, j, column, last, vocab = logits.shape[1], words = (logits.shape[1] + 31) // 32
    cdef uint32_t word
    cdef float* out
    for i in range(rows.shape[0]):
        out = &logits[rows[i], 0]
        for w in range(words):
            if bitmask[slots[i], w] == -1:
                continue
            word = <uint32_t>bitmask[slots[i], w]
            column = 32 * w
            last = vocab - column if vocab - column < 32 else 32
            for j in range(last):
                if not (word >> j) & 1:
                    out[column + j] = -INFINITY


def apply_bitmask(float[:, ::1] logits, const int32_t[:, ::1] bitmask, const int32_t[::1] rows,
                  const int32_t[::1] slots) -> None:
    cdef Py_ssize_t i, num_rows = logits.shape[0], num_slots = bitmask.shape[0]
    if rows.shape[0] != slots.shape[0]:
        raise ValueError("apply_bitmask needs one bitmask slot per row")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot mask {logits.shape[1]} tokens")
    for i in range(rows.shape[0]):
        if not (0 <= rows[i] < num_rows and 0 <= slots[i] < num_slots):
            raise IndexError(f"row {rows[i]} or slot {slots[i]} is outside the logits' {num_rows} rows or the "
                             f"bitmask's {num_slots}")
    if rows.shape[0] * bitmask.shape[1] >= NOGIL_WORDS:
        with nogil:
            _apply(logits, bitmask, rows, slots)
    else:
        _apply(logits, bitmask, rows, slots)
