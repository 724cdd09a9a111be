# cython: language_level=3, boundscheck=False, wraparound=False
"""Assembling a step's grammar bitmask over the batch, compiled. Twin: ext/bitmask_py.py."""
cimport numpy as cnp
from libc.string cimport memset

cnp.import_array()


def fill_batch_bitmask(cnp.ndarray[cnp.int32_t, ndim=2] bitmask, list rows, fill):
    if not bitmask.flags.c_contiguous:
        raise ValueError("the bitmask buffer must be C-contiguous")
    cdef Py_ssize_t num_rows = bitmask.shape[0], row_bytes = bitmask.shape[1] * sizeof(cnp.int32_t)
    cdef char *data = <char *>bitmask.data
    cdef Py_ssize_t start = 0, row
    # rows without a grammar allow everything; the grammar rows are fully written by `fill`. The
    # GIL stays held: releasing it for a memset costs the device thread a wait to get it back.
    for row in rows:
        if not 0 <= row < num_rows:
            raise IndexError(f"grammar row {row} is outside the bitmask's {num_rows} rows")
    for row in sorted(rows) + [num_rows]:
        if row > start:
            memset(data + start * row_bytes, 0xFF, (row - start) * row_bytes)
        start = max(start, row + 1)
    if rows:
        fill(rows)
