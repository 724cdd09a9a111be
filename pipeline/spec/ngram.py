"""The n-gram drafter (prompt lookup): drafts are what followed the latest earlier occurrence of the sequence's
longest recurring suffix of ``min_n``..``max_n`` tokens, in its prompt and output (ext/ngram.pyx says how it
searches). No model and no device work: it suits agents that quote back files and tool output."""
from __future__ import annotations

import numpy as np

import ext
from pipeline.sequence import Sequence
from pipeline.spec.drafter import HostDrafter

_ngram = ext.load("ngram")


class TokenHistory:
    """A sequence's tokens as one growing int64 array (the search reads an array; rebuilding it from the token
    list every step would cost as much as the search)."""

    __slots__ = ("buffer", "length")

    def __init__(self) -> None:
        self.buffer = np.zeros(256, dtype=np.int64)
        self.length = 0

    def sync(self, tokens: list[int]) -> None:
        """Append the tokens added since the last call (a sequence's token list only grows)."""
        new = len(tokens)
        if new <= self.length:
            return
        if new > len(self.buffer):
            grown = np.zeros(max(new, 2 * len(self.buffer)), dtype=np.int64)
            grown[:self.length] = self.buffer[:self.length]
            self.buffer = grown
        self.buffer[self.length:new] = tokens[self.length:new]
        self.length = new


class NgramDrafter(HostDrafter):
    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` drafts to follow ``seq``'s tokens (empty when no suffix recurs)."""
        history = seq.draft_history
        if history is None:
            history = seq.draft_history = TokenHistory()
        history.sync(seq.token_ids)
        return _ngram.propose(history.buffer, history.length, k, self.min_n, self.max_n)
