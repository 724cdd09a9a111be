"""The acceptance rule, and what it counts.

A verify row picks a token after the sequence's last one and after each draft, every pick as plain decoding would
make it at that output position (the same logits pipeline and the same random draw). The drafts are accepted while
they equal those picks, and the picks up to the first difference are the sequence's next tokens: exactly what
decoding one token at a time gives, so a drafter can be wrong but never changes the output.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def accepted_drafts(drafts: Sequence[int], picks: Sequence[int], first: int, accepts_all: bool = False) -> int:
    """How many of ``drafts`` are taken: the leading ones equal to the picks from ``picks[first]`` on (all of them
    with ``accepts_all``, the benchmarks' forced acceptance: pipeline/spec/replay.py)."""
    if accepts_all:
        return len(drafts)
    accepted = 0
    while accepted < len(drafts) and picks[first + accepted] == drafts[accepted]:
        accepted += 1
    return accepted


@dataclass(slots=True)
class SpecStats:
    """Speculation counters: drafts offered and accepted, and how many of a row's drafts were."""

    verify_rows: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_row: list[int] = field(default_factory=list)  # [a]: rows that accepted a drafts (0..K)
    filler_tokens: int = 0  # drafts that only give a step's rows one length (filler drafts), and how many held
    filler_accepted: int = 0
    device_drafts: int = 0  # drafts the verify rows took from the device, read after the step (device_drafts.py)

    def count_row(self, proposed: int, fillers: int, accepted: int) -> None:
        """A verify row of ``proposed`` drafter drafts then ``fillers`` filler drafts, ``accepted`` of them taken."""
        if proposed:
            self.verify_rows += 1
            self.drafted_tokens += proposed
            self.accepted_tokens += min(accepted, proposed)
            self.accepted_per_row[min(accepted, proposed)] += 1
        self.filler_tokens += fillers
        self.filler_accepted += max(0, accepted - proposed)
