"""How many drafts a row verifies: K while drafts pay, fewer where they stop paying.

A verify row of K + 1 tokens reads the weights once, like a decode row, so at small batches it costs little more than
one token (H100, Qwen3-8B shape: 1.11 decode steps with 7 drafts at batch 1) and any accepted draft is a gain; at
larger batches the step is compute-bound and the same row costs more (1.98 steps at batch 64, bench/README.md), so a
batch past ``max_rows`` drafts nothing. A sequence whose drafts keep failing (an acceptance average under
``low_acceptance``) verifies one draft a step, which still finds out when its output starts repeating itself.
"""
from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.2  # weight of the latest row in a sequence's acceptance average
MAX_DRAFT_ROWS = 32  # running sequences above which no row drafts (hybrid models keep a spare state slot for each)


@dataclass(slots=True)
class DraftBudget:
    k: int  # the configured drafts per row
    max_rows: int = MAX_DRAFT_ROWS  # running sequences above which no row drafts
    low_acceptance: float = 0.3  # below this average a sequence verifies one draft a step

    def for_step(self, running: int) -> int:
        """The most drafts a row may verify in a step of ``running`` sequences."""
        return self.k if running <= self.max_rows else 0

    def for_sequence(self, limit: int, acceptance: float) -> int:
        """Drafts for one sequence under the step's ``limit``, from its acceptance average."""
        return min(limit, 1) if acceptance < self.low_acceptance else limit

    @staticmethod
    def observe(acceptance: float, drafted: int, accepted: int) -> float:
        """A sequence's acceptance average after a row that verified ``drafted`` drafts."""
        return acceptance if not drafted else (1 - SMOOTHING) * acceptance + SMOOTHING * accepted / drafted
