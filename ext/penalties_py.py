"""Pure-Python twin of ext/penalties.pyx: penalty bookkeeping per sequence, and the batch's sparse
penalty inputs.

Repetition, presence and frequency penalties need, per row, which tokens occurred and how often.
Rebuilding that from the whole token list every step costs O(prompt + output) per row per step;
here each sequence keeps its counts and updates them with every appended token (O(1)), and a step
gathers only the distinct tokens of each row.
"""
from __future__ import annotations

import numpy as np


class TokenCounts:
    """Distinct prompt tokens, and occurrence counts of output tokens, of one sequence."""

    def __init__(self, prompt_ids) -> None:
        self.prompt = set(prompt_ids)
        self.output: dict[int, int] = {}

    def add(self, token: int) -> None:
        self.output[token] = self.output.get(token, 0) + 1

    def add_all(self, tokens) -> None:
        for token in tokens:
            self.add(token)

    def with_tokens(self, tokens) -> TokenCounts:
        """A copy with ``tokens`` added to the output (the prompt's set shared, not copied): a speculative verify
        row's counts, as if the drafts before it were accepted."""
        copy = TokenCounts.__new__(TokenCounts)
        copy.prompt = self.prompt
        copy.output = dict(self.output)
        copy.add_all(tokens)
        return copy


def penalty_inputs(seen_rows: list, counted_rows: list, vocab_size: int):
    """Flat (row * V + token) indices for the batch.

    seen_rows: (row, TokenCounts) needing the seen set (prompt or output) -> int64 indices, each once.
    counted_rows: (row, TokenCounts) needing output counts -> int64 indices and float32 counts.
    """
    seen: list[int] = []
    for row, counts in seen_rows:
        base = row * vocab_size
        tokens = counts.prompt | counts.output.keys()
        seen.extend(base + t for t in tokens)
    counted: list[int] = []
    values: list[float] = []
    for row, counts in counted_rows:
        base = row * vocab_size
        for token, count in counts.output.items():
            counted.append(base + token)
            values.append(count)
    return (np.asarray(seen, dtype=np.int64), np.asarray(counted, dtype=np.int64),
            np.asarray(values, dtype=np.float32))
