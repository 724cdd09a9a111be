"""Pure-Python twin of ext/bitmask.pyx: assembling a step's grammar bitmask over the batch.

Rows without a grammar allow every token (all bits set); the grammar rows are written in one call
by `fill(rows)` (xgrammar's batch matcher, into a tensor view of the same buffer), which sets every
word of them, so only the other rows are set here: a batch where every row has a grammar costs no
extra pass.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np


def fill_batch_bitmask(bitmask: np.ndarray, rows: list[int], fill: Callable[[list[int]], None]) -> None:
    """bitmask: int32 [S, W], C-contiguous; rows: the grammar rows (any order), written by `fill`."""
    if not bitmask.flags.c_contiguous:
        raise ValueError("the bitmask buffer must be C-contiguous")
    for row in rows:
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"grammar row {row} is outside the bitmask's {bitmask.shape[0]} rows")
    free = np.ones(bitmask.shape[0], dtype=bool)
    free[rows] = False
    bitmask[free] = -1
    if rows:
        fill(rows)
