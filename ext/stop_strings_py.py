"""Pure-Python twin of ext/stop_strings.pyx: stop-string matching over streamed text, with hold-back.

A stop string can arrive split over many deltas, so text that could still become the start of a
stop is held back instead of emitted: once emitted, text cannot be taken back from the client.
The result never depends on how the text was chunked: the earliest occurrence in the whole
stream wins, and of stops starting at the same position the shorter one wins.

Cost per feed is O((len(delta) + longest stop) * number of stops): only the held text (shorter
than the longest stop) is rescanned, never the whole output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(slots=True, init=False)
class StopStringMatcher:
    """Feed text deltas; get back what is safe to emit and whether a stop string matched."""

    stops: tuple[str, ...]
    include_stop_str_in_output: bool
    _proper_prefixes: frozenset[str]  # every non-empty proper prefix of every stop
    _longest: int
    _held: str  # suffix of the text seen that a stop may still start in
    _matched: str | None

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        # Empty strings would match everywhere; duplicates change nothing.
        self.stops = tuple(dict.fromkeys(s for s in stop if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self._proper_prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self._matched = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._matched

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop matched). After a match: ('', True)."""
        if self._matched is not None:
            return "", True
        text = self._held + delta
        hit = self._earliest_complete(text)
        end = hit[0] if hit is not None else len(text)
        # A longer stop starting before the complete hit could still complete and would win.
        pending = self._earliest_pending(text, end)
        if hit is not None and pending is None:
            return self._finish(text, *hit), True
        cut = end if pending is None else pending
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """The sequence ended: release held text, or, if it holds a complete stop that was waiting
        on a longer earlier candidate, the text before that stop (check `matched` afterwards)."""
        if self._matched is not None:
            return ""
        text, self._held = self._held, ""
        hit = self._earliest_complete(text)
        return text if hit is None else self._finish(text, *hit)

    def _earliest_complete(self, text: str) -> tuple[int, str] | None:
        """Earliest-starting stop in text; the shorter one on a tie."""
        best: tuple[int, str] | None = None
        for stop in self.stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start, len(stop)) < (best[0], len(best[1]))):
                best = (start, stop)
        return best

    def _earliest_pending(self, text: str, end: int) -> int | None:
        """Earliest start before `end` of a suffix of text that is a proper prefix of a stop."""
        for start in range(max(0, len(text) - self._longest + 1), end):
            if text[start:] in self._proper_prefixes:
                return start
        return None

    def _finish(self, text: str, start: int, stop: str) -> str:
        self._matched, self._held = stop, ""
        return text[:start] + (stop if self.include_stop_str_in_output else "")
