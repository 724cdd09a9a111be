"""A drafter that replays known continuations, each draft wrong with a given probability: what measures the
verify path at a chosen acceptance (benchmarks on random weights, whose outputs n-gram lookup rarely predicts) and
what tests rejections at every position of a row with. Not a serving drafter."""
from __future__ import annotations

import random

from pipeline.sequence import Sequence


class ReplayDrafter:
    name = "replay"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], error: float = 0.0, seed: int = 0) -> None:
        self.continuations = continuations  # prompt -> its output without speculation
        self.error = error  # probability that a draft is replaced by another token
        self.rng = random.Random(seed)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        known = self.continuations.get(tuple(seq.request.prompt_token_ids), [])
        position = seq.num_output_tokens
        return [t + 1 if self.rng.random() < self.error else t for t in known[position:position + k]]
