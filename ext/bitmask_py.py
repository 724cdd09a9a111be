"""Pure-Python twin of ext/bitmask.pyx: assembling a step's grammar bitmask over the batch.

Rows without a grammar allow every token (all bits set); each grammar row is written by its
matcher (xgrammar fills its row of the shared int32 buffer in place).
"""
from __future__ import annotations

import numpy as np
import torch


def fill_batch_bitmask(bitmask: np.ndarray, grammar_rows: list) -> None:
    """bitmask: int32 [S, W] (a writable numpy view); grammar_rows: (row, state with fill(tensor, row))."""
    bitmask.fill(-1)
    if not grammar_rows:
        return
    tensor = torch.from_numpy(bitmask)
    for row, state in grammar_rows:
        state.fill(tensor, row)
