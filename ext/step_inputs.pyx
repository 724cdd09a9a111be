# cython: boundscheck=False, wraparound=False, language_level=3
"""Compiled step-input building; the pure-Python twin is ext/step_inputs_py.py."""
import numpy as np
cimport numpy as cnp

cnp.import_array()


def build_step_inputs(list token_lists, list start_positions, list block_lists, Py_ssize_t block_size):
    cdef Py_ssize_t num_seqs = len(token_lists)
    cdef Py_ssize_t total = 0, max_blocks = 1, b, j, cursor = 0, pos, start, n, needed
    cdef list tokens, blocks
    # A table holds the blocks the positions reach, no more: a sequence's list may already hold blocks
    # for tokens past this step (a lookahead), and the table's width must not depend on them.
    for b in range(num_seqs):
        n = len(<list>token_lists[b])
        total += n
        needed = (<Py_ssize_t>start_positions[b] + n + block_size - 1) // block_size
        if needed > max_blocks:
            max_blocks = needed
    input_ids_arr = np.empty(total, dtype=np.int64)
    positions_arr = np.empty(total, dtype=np.int64)
    slots_arr = np.empty(total, dtype=np.int64)
    qsl_arr = np.empty(num_seqs + 1, dtype=np.int32)
    lens_arr = np.empty(num_seqs, dtype=np.int32)
    tables_arr = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    cdef cnp.int64_t[::1] input_ids = input_ids_arr
    cdef cnp.int64_t[::1] positions = positions_arr
    cdef cnp.int64_t[::1] slots = slots_arr
    cdef cnp.int32_t[::1] qsl = qsl_arr
    cdef cnp.int32_t[::1] lens = lens_arr
    cdef cnp.int32_t[:, ::1] tables = tables_arr
    qsl[0] = 0
    for b in range(num_seqs):
        tokens = <list>token_lists[b]
        blocks = <list>block_lists[b]
        start = <Py_ssize_t>start_positions[b]
        n = len(tokens)
        if start < 0 or len(blocks) * block_size < start + n:
            raise ValueError(f"sequence {b}: {len(blocks)} blocks cannot hold positions up to {start + n}")
        for j in range(n):
            pos = start + j
            input_ids[cursor] = <cnp.int64_t>tokens[j]
            positions[cursor] = pos
            slots[cursor] = <cnp.int64_t>blocks[pos // block_size] * block_size + pos % block_size
            cursor += 1
        qsl[b + 1] = <cnp.int32_t>cursor
        lens[b] = <cnp.int32_t>(start + n)
        for j in range((start + n + block_size - 1) // block_size):
            tables[b, j] = <cnp.int32_t>blocks[j]
    return input_ids_arr, positions_arr, slots_arr, qsl_arr, lens_arr, tables_arr
