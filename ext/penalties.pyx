# cython: language_level=3, boundscheck=False, wraparound=False
"""Penalty bookkeeping per sequence, and the batch's sparse penalty inputs, compiled.
Twin: ext/penalties_py.py (same results; tests/ext/test_penalties.py)."""
import numpy as np
cimport numpy as cnp

cnp.import_array()


cdef class TokenCounts:
    cdef public set prompt
    cdef public dict output

    def __init__(self, prompt_ids):
        self.prompt = set(prompt_ids)
        self.output = {}

    cpdef void add(self, long long token):
        cdef object key = token
        self.output[key] = self.output.get(key, 0) + 1

    def add_all(self, tokens):
        for token in tokens:
            self.add(token)

    def with_tokens(self, tokens):
        """A copy with ``tokens`` added to the output (the prompt's set shared, not copied)."""
        cdef TokenCounts copy = TokenCounts.__new__(TokenCounts)
        copy.prompt = self.prompt
        copy.output = dict(self.output)
        copy.add_all(tokens)
        return copy


def penalty_inputs(list seen_rows, list counted_rows, long long vocab_size):
    cdef Py_ssize_t n_seen = 0, n_counted = 0, i
    cdef TokenCounts counts
    cdef long long base, row
    for row, counts in seen_rows:
        n_seen += len(counts.prompt) + len(counts.output)
    for row, counts in counted_rows:
        n_counted += len(counts.output)
    cdef cnp.ndarray[cnp.int64_t, ndim=1] seen = np.empty(n_seen, dtype=np.int64)
    cdef cnp.ndarray[cnp.int64_t, ndim=1] counted = np.empty(n_counted, dtype=np.int64)
    cdef cnp.ndarray[cnp.float32_t, ndim=1] values = np.empty(n_counted, dtype=np.float32)
    i = 0
    for row, counts in seen_rows:
        base = row * vocab_size
        for token in counts.prompt:
            seen[i] = base + <long long>token
            i += 1
        for token in counts.output:
            if token not in counts.prompt:
                seen[i] = base + <long long>token
                i += 1
    seen = seen[:i]
    i = 0
    for row, counts in counted_rows:
        base = row * vocab_size
        for token, count in counts.output.items():
            counted[i] = base + <long long>token
            values[i] = <float>count
            i += 1
    return seen, counted, values
