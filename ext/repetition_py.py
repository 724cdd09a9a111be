"""Pure-Python twin of ext/repetition.pyx: the loop guard's repetition detector.

Detects an output that ends in a pattern of L tokens (min_size <= L <= max_size) repeated at least
min_count times back to back. For every period L it keeps run[L], the number of consecutive latest
tokens equal to the token L positions earlier; the output's tail is L-periodic over run[L] + L
tokens, i.e. (run[L] + L) // L repetitions. O(max_size) per token, no rescan of the history.
"""
from __future__ import annotations


class RepetitionDetector:
    def __init__(self, min_size: int, max_size: int, min_count: int) -> None:
        if not 1 <= min_size <= max_size or min_count < 2:
            raise ValueError(f"bad repetition detection: sizes {min_size}..{max_size}, min_count {min_count}")
        self.min_size = min_size
        self.max_size = max_size
        self.min_count = min_count
        self._ring = [0] * max_size  # the last max_size tokens, at index position % max_size
        self._run = [0] * (max_size + 1)
        self._count = 0  # tokens fed
        self.pattern_size = 0  # L of the repetition found (0: none)

    def feed(self, token: int) -> bool:
        """Add one output token; True once the output ends in a long enough repetition."""
        n = self._count
        size = self.max_size
        found = False
        for period in range(1, size + 1):
            if period <= n and self._ring[(n - period) % size] == token:
                self._run[period] += 1
                if (not found and period >= self.min_size
                        and self._run[period] >= period * (self.min_count - 1)):
                    found = True
                    self.pattern_size = period
            else:
                self._run[period] = 0
        self._ring[n % size] = token
        self._count = n + 1
        return found
