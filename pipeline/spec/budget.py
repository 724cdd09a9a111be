"""How many drafts a row verifies: K while drafts pay, fewer where they stop paying.

A verify row of K + 1 tokens reads the weights once, like a decode row, so at small batches it costs little more than
one token (H100, Qwen3-8B shape: 1.11 decode steps with 7 drafts at batch 1) and any accepted draft is a gain; at
larger batches the step is compute-bound and the same row costs more (1.98 steps at batch 64, bench/README.md), so a
batch past ``max_rows`` drafts nothing. A sequence whose drafts keep failing (an acceptance average under
``low_acceptance``) verifies one draft a step.

A step in which any row drafts cannot run one step ahead (a row's drafts follow its last token, which the host must
have read), and that costs as much as the verify row at batch 1. So a sequence whose drafts were all rejected waits
before its next chance: 1, 2, 4 .. ``MAX_WAIT`` steps, running ahead meanwhile; an accepted draft ends the wait. A
drafter that is never right then costs a failed chance in ``MAX_WAIT`` steps. On a hybrid mixture-of-experts model a
failed chance at batch 1 cost about six decode steps while rejected rows were fed again (the verify row reads the
experts of every token it holds), so a cap of 16 steps cost it 23%. A chance with nothing offered (no n-gram match)
waits one step.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.sequence import Sequence

SMOOTHING = 0.2  # weight of the latest row in a sequence's acceptance average
MAX_DRAFT_ROWS = 32  # running sequences above which no row drafts
# hybrid models: spare state slots a drafting sequence has on average, each keeping the state after one token of its
# verify row (a Qwen3.5-35B-A3B state is 61 MiB: 32 x 4 of them are 7.8 GiB); a row drafts no more than it can keep
KEPT_STATES_PER_ROW = 4
MAX_WAIT = 64  # the longest wait, in steps, between a sequence's chances to draft after they brought nothing


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

    @staticmethod
    def tick(running: Iterable[Sequence]) -> bool:
        """A step passes: every waiting sequence's wait shortens. Returns whether any sequence may draft in it."""
        due = False
        for seq in running:
            if seq.draft_wait:
                seq.draft_wait -= 1
            else:
                due = True
        return due

    @staticmethod
    def settle(seq: Sequence, drafted: int, accepted: int) -> None:
        """After a sequence's chance to draft: its acceptance average, and its wait before the next chance."""
        seq.draft_acceptance = DraftBudget.observe(seq.draft_acceptance, drafted, accepted)
        if accepted:
            seq.draft_backoff = 0
        elif drafted:
            seq.draft_backoff = seq.draft_wait = min(max(1, 2 * seq.draft_backoff), MAX_WAIT)
        else:  # nothing offered (no n-gram match): a lookup is cheap, one step ahead in two is kept
            seq.draft_wait = 1
