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

Exact speculation on a GPU (``--exact-speculation``) computes each verified token as a one-token row, about
``EXACT_TOKEN_COST`` decode steps a token (bench/README.md), so there a row is worth its drafts only where its
expected tokens, ``1 + p + .. + p^k`` at a per-draft acceptance p, outrun its cost ``1 + cost * k``: in the
one-sequence steps that compute such rows the sequence verifies the k that gains most per step, at least one (a
probe, so the acceptance estimate can recover), with no filler drafts after them; its failed chances wait as
above, and so do its accepted ones while drafting does not pay at its average.
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
# decode steps a verified token adds to its row when verify rows are computed as one-token rows (a 5-token row of the
# Qwen3-8B shape took 4.4 decode steps on an H100: bench/README.md, "Verify rows computed as decode rows")
EXACT_TOKEN_COST = 0.85


def draft_token_cost(exact_speculation: bool, on_gpu: bool) -> float:
    """``DraftBudget.token_cost`` for an engine: exact verify rows cost about a decode step a token on a GPU; elsewhere
    (the CPU's torch kernels, the GPU's multi-row kernels) a row's tokens cost little more than one."""
    return EXACT_TOKEN_COST if exact_speculation and on_gpu else 0.0


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens a row of k drafts yields when each draft holds with probability ``acceptance`` (the row's own token,
    then drafts until the first rejected one)."""
    return float(k + 1) if acceptance >= 1.0 else (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass(slots=True)
class DraftBudget:
    k: int  # the configured drafts per row
    max_rows: int = MAX_DRAFT_ROWS  # running sequences above which no row drafts
    low_acceptance: float = 0.3  # below this average a sequence verifies one draft a step
    token_cost: float = 0.0  # decode steps each draft adds to its verify row (0: a row costs about one step)

    def for_step(self, running: int) -> int:
        """The most drafts a row may verify in a step of ``running`` sequences."""
        return self.k if running <= self.max_rows else 0

    def priced(self, running: int) -> bool:
        """Whether a step of ``running`` sequences prices its drafts: exact rows are one-sequence steps' (larger
        batches verify on the multi-row kernels, as they decode)."""
        return self.token_cost > 0.0 and running == 1

    def for_sequence(self, limit: int, acceptance: float, priced: bool = False) -> int:
        """Drafts for one sequence under the step's ``limit``, from its acceptance average (``priced``: the k that
        pays most)."""
        if priced:
            return self.paying_drafts(limit, acceptance)
        return min(limit, 1) if acceptance < self.low_acceptance else limit

    def pays(self, acceptance: float) -> bool:
        """Whether some row of up to K drafts yields more than one token per decode step at this acceptance."""
        return self._best(self.k, acceptance)[1] > 1.0

    def after_row(self, seq: Sequence, drafted: int, accepted: int, priced: bool) -> None:
        """``settle`` after a verify row; where the row was priced and drafting does not pay at the sequence's new
        average, its chances keep backing off even when a probe was accepted (the average still moves)."""
        backoff = seq.draft_backoff
        DraftBudget.settle(seq, drafted, accepted)
        if priced and drafted and not self.pays(seq.draft_acceptance):
            seq.draft_backoff = seq.draft_wait = min(max(1, 2 * backoff), MAX_WAIT)

    def paying_drafts(self, limit: int, acceptance: float) -> int:
        """The k <= ``limit`` whose row yields the most tokens per decode step it costs; 1 where none pays (a
        probe: the acceptance average moves only on verified rows), 0 under a zero limit."""
        return self._best(limit, acceptance)[0]

    def _best(self, limit: int, acceptance: float) -> tuple[int, float]:
        """(k, tokens per decode step) of the best row of 1..``limit`` drafts; (0, 0.0) under a zero limit."""
        best_k, best = 0, 0.0
        for k in range(1, limit + 1):
            rate = expected_tokens(k, acceptance) / (1.0 + self.token_cost * k)
            if rate > best:
                best_k, best = k, rate
        return best_k, best

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
