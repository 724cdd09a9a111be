"""Pure-Python twin of ext/bitmask.pyx: a step's grammar bitmask on the host.

A step's bitmask holds one int32 row of ceil(V/32) words per constrained row (bit j of word w allows token 32w + j),
filled by xgrammar. `masking_rows` finds the rows that refuse some token: a row that allows everything (a tool
grammar before its trigger, free text) needs no copy to the device and no masking. `apply_bitmask` is the CPU's
masking: logits row rows[i] gets -inf wherever bitmask row slots[i] refuses the token, word by word, skipping the
words that allow all 32 (most of them, in free text or inside a JSON string).
"""
from __future__ import annotations

import numpy as np


def _bits(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """uint8 [..., V]: each token's bit."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, bitorder="little")[..., :vocab_size]


def masking_rows(bitmask: np.ndarray, count: int, vocab_size: int) -> list[int]:
    """The rows among the first `count` that refuse some token below vocab_size."""
    if not 0 <= count <= bitmask.shape[0]:
        raise IndexError(f"{count} rows asked of a bitmask of {bitmask.shape[0]}")
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot hold {vocab_size} tokens")
    return np.flatnonzero(~_bits(bitmask[:count], vocab_size).all(axis=-1)).tolist()


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray, slots: np.ndarray) -> None:
    """logits float32 [S, V] (C-contiguous), in place; bitmask int32 [N, W]; rows and slots int32 [K]."""
    if logits.dtype != np.float32 or not logits.flags.c_contiguous or bitmask.dtype != np.int32:
        raise ValueError("apply_bitmask needs C-contiguous float32 logits and an int32 bitmask")
    if len(rows) != len(slots):
        raise ValueError("apply_bitmask needs one bitmask slot per row")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot mask {logits.shape[1]} tokens")
    for row, slot in zip(np.asarray(rows).tolist(), np.asarray(slots).tolist()):
        if not (0 <= row < logits.shape[0] and 0 <= slot < bitmask.shape[0]):
            raise IndexError(f"row {row} or slot {slot} is outside the logits' {logits.shape[0]} rows or the "
                             f"bitmask's {bitmask.shape[0]}")
        logits[row, _bits(bitmask[slot], logits.shape[1]) == 0] = -np.inf
