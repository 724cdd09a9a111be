"""The acceptance rule and its counters (pipeline/spec/acceptance.py)."""
from __future__ import annotations

from pipeline.spec.acceptance import SpecStats, accepted_drafts


def test_drafts_are_taken_while_they_equal_the_picks():
    picks = [9, 5, 6, 7, 1, 2]  # a row after another sequence's one pick: this row's picks start at 1
    assert accepted_drafts([5, 6, 7, 8], picks, 1) == 3  # the pick after draft 3 (1) differs from draft 4
    assert accepted_drafts([6, 6], picks, 1) == 0
    assert accepted_drafts([5, 6, 7, 1, 2], picks, 1) == 5  # every draft: the pick after them is the bonus token
    assert accepted_drafts([], picks, 1) == 0
    assert accepted_drafts([4, 4], picks, 1, accepts_all=True) == 2


def test_rows_are_counted_apart_from_their_fillers():
    stats = SpecStats(accepted_per_row=[0] * 5)
    stats.count_row(3, 1, 4)  # three drafts and a filler, all taken
    stats.count_row(2, 0, 1)
    stats.count_row(0, 4, 2)  # fillers only: no verify row of the drafter's
    assert (stats.verify_rows, stats.drafted_tokens, stats.accepted_tokens) == (2, 5, 4)
    assert stats.accepted_per_row == [0, 1, 0, 1, 0]
    assert (stats.filler_tokens, stats.filler_accepted) == (5, 3)
