# cython: language_level=3, boundscheck=False, wraparound=False
"""Stop-string matching over streamed text, with hold-back, compiled. Twin: ext/stop_strings_py.py
(the same algorithm line for line; tests/ext/test_stop_strings_ext.py proves equal results).

A stop string can arrive split over many deltas, so text that could still become the start of a
stop is held back instead of emitted. The earliest occurrence in the whole stream wins; of stops
starting at the same position the shorter one wins. Only the held text is rescanned per feed.
"""


cdef class StopStringMatcher:
    cdef public tuple stops
    cdef public bint include_stop_str_in_output
    cdef frozenset _proper_prefixes
    cdef Py_ssize_t _longest
    cdef str _held
    cdef object _matched

    def __init__(self, stop, bint include_stop_str_in_output=False):
        self.stops = tuple(dict.fromkeys(s for s in stop if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self._proper_prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self._matched = None

    @property
    def matched(self):
        return self._matched

    def feed(self, str delta):
        cdef str text
        cdef Py_ssize_t end, cut
        if self._matched is not None:
            return "", True
        text = self._held + delta
        hit = self._earliest_complete(text)
        end = hit[0] if hit is not None else len(text)
        pending = self._earliest_pending(text, end)
        if hit is not None and pending is None:
            return self._finish(text, hit[0], hit[1]), True
        cut = end if pending is None else pending
        self._held = text[cut:]
        return text[:cut], False

    def flush(self):
        cdef str text
        if self._matched is not None:
            return ""
        text, self._held = self._held, ""
        hit = self._earliest_complete(text)
        return text if hit is None else self._finish(text, hit[0], hit[1])

    cdef object _earliest_complete(self, str text):
        cdef Py_ssize_t start, best_start = -1, best_len = 0
        cdef str stop, best_stop = None
        for stop in self.stops:
            start = text.find(stop)
            if start >= 0 and (best_start < 0 or start < best_start
                               or (start == best_start and len(stop) < best_len)):
                best_start, best_len, best_stop = start, len(stop), stop
        return None if best_start < 0 else (best_start, best_stop)

    cdef object _earliest_pending(self, str text, Py_ssize_t end):
        cdef Py_ssize_t start, n = len(text)
        cdef Py_ssize_t first = n - self._longest + 1
        if first < 0:
            first = 0
        for start in range(first, end):
            if text[start:] in self._proper_prefixes:
                return start
        return None

    cdef str _finish(self, str text, Py_ssize_t start, str stop):
        self._matched, self._held = stop, ""
        return text[:start] + (stop if self.include_stop_str_in_output else "")
