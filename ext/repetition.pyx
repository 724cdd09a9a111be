# cython: boundscheck=False, wraparound=False, cdivision=True
"""The loop guard's repetition detector, compiled. Twin: ext/repetition_py.py (same algorithm,
same results; tests/ext/test_repetition.py proves it)."""
from libc.stdlib cimport calloc, free


cdef class RepetitionDetector:
    cdef public int min_size, max_size, min_count, pattern_size
    cdef long long _count
    cdef long long *_ring
    cdef long long *_run

    def __cinit__(self, int min_size, int max_size, int min_count):
        if not (1 <= min_size <= max_size) or min_count < 2:
            raise ValueError(f"bad repetition detection: sizes {min_size}..{max_size}, min_count {min_count}")
        self._ring = <long long *>calloc(max_size, sizeof(long long))
        self._run = <long long *>calloc(max_size + 1, sizeof(long long))
        if self._ring == NULL or self._run == NULL:
            raise MemoryError()

    def __init__(self, int min_size, int max_size, int min_count):
        self.min_size = min_size
        self.max_size = max_size
        self.min_count = min_count
        self.pattern_size = 0
        self._count = 0

    def __dealloc__(self):
        free(self._ring)
        free(self._run)

    cpdef bint feed(self, long long token):
        cdef long long n = self._count
        cdef int size = self.max_size
        cdef int period
        cdef bint found = False
        for period in range(1, size + 1):
            if period <= n and self._ring[(n - period) % size] == token:
                self._run[period] += 1
                if (not found and period >= self.min_size
                        and self._run[period] >= <long long>period * (self.min_count - 1)):
                    found = True
                    self.pattern_size = period
            else:
                self._run[period] = 0
        self._ring[n % size] = token
        self._count = n + 1
        return found
