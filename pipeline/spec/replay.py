"""A drafter that replays known continuations, each draft wrong with a given probability: what measures the
verify path at a chosen acceptance (benchmarks on random weights, whose outputs n-gram lookup rarely predicts) and
what tests rejections at every position of a row with. Not a serving drafter.

``forced``: the decode stage takes every draft as if it had been picked. On a GPU the verify rows' bf16 sums differ
from one-token rows' (bench/README.md), so replayed drafts stop matching after the first near-tie; forcing them
measures what the verify mechanism gives at full acceptance (the issue's oracle) without that. The tokens are then
the replayed ones, not the model's: for timing only."""
from __future__ import annotations

import random

from pipeline.sequence import Sequence
from pipeline.spec.drafter import HostDrafter


class ReplayDrafter(HostDrafter):
    name = "replay"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], error: float = 0.0, seed: int = 0,
                 forced: bool = False) -> None:
        self.continuations = continuations  # prompt -> its output without speculation
        self.error = error  # probability that a draft is replaced by another token
        self.rng = random.Random(seed)
        self.accepts_all = forced

    def propose(self, seq: Sequence, k: int) -> list[int]:
        known = self.continuations.get(tuple(seq.request.prompt_token_ids), [])
        position = seq.num_output_tokens
        return [t + 1 if self.rng.random() < self.error else t for t in known[position:position + k]]
