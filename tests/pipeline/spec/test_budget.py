"""How many drafts a row verifies (pipeline/spec/budget.py)."""
from __future__ import annotations

import pytest

from pipeline.spec.budget import DraftBudget


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
