"""How many drafts a row verifies (pipeline/spec/budget.py)."""
from __future__ import annotations

import pytest

from types import SimpleNamespace

from pipeline.spec.budget import MAX_WAIT, DraftBudget


def test_large_batches_draft_nothing_and_failing_sequences_one():
    budget = DraftBudget(k=5, max_rows=32)
    assert budget.for_step(1) == 5 and budget.for_step(32) == 5 and budget.for_step(33) == 0
    assert budget.for_sequence(5, 0.9) == 5 and budget.for_sequence(5, 0.1) == 1 and budget.for_sequence(0, 0.1) == 0


def test_acceptance_average():
    acceptance = 1.0
    for _ in range(10):
        acceptance = DraftBudget.observe(acceptance, 4, 0)
    assert acceptance == pytest.approx(0.8 ** 10)
    assert DraftBudget.observe(0.5, 0, 0) == 0.5  # a row without drafts says nothing
    assert DraftBudget.observe(0.0, 2, 2) == pytest.approx(0.2)


def test_failed_chances_wait_longer_and_an_accepted_draft_ends_the_wait():
    seq = SimpleNamespace(draft_acceptance=1.0, draft_wait=0, draft_backoff=0)
    chances, waits = [], []
    for step in range(400):
        if DraftBudget.tick([seq]):
            chances.append(step)
            DraftBudget.settle(seq, 4, 0)
            waits.append(seq.draft_wait)
    assert waits[:8] == [1, 2, 4, 8, 16, 32, 64, 64] and max(waits) == MAX_WAIT
    assert chances[:5] == [0, 2, 5, 10, 19] and len(chances) < 400 / MAX_WAIT + 6
    DraftBudget.settle(seq, 4, 1)
    assert seq.draft_backoff == 0 and DraftBudget.tick([seq]) is False  # the wait given before still runs out
    while not DraftBudget.tick([seq]):
        pass
    DraftBudget.settle(seq, 0, 0)  # nothing offered: one step, the backoff kept
    assert seq.draft_wait == 1 and seq.draft_backoff == 0
