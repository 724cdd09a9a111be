"""Pure-Python twin of ext/bitmask.pyx: assembling a step's grammar bitmask over the batch.

Rows without a grammar allow every token (all bits set); the grammar rows are then written in one
call by `fill(tensor, rows)` (xgrammar's batch matcher fills them in parallel threads).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def fill_batch_bitmask(bitmask: np.ndarray, rows: list[int], fill: Callable[[torch.Tensor, list[int]], None]) -> None:
    """bitmask: int32 [S, W], C-contiguous; rows: the grammar rows, written by `fill`."""
    if not bitmask.flags.c_contiguous:
        raise ValueError("the bitmask buffer must be C-contiguous")
    bitmask.fill(-1)
    if rows:
        fill(torch.from_numpy(bitmask), rows)
