"""Pure-Python twin of ext/step_inputs.pyx: flatten one step's chunks into the model's input arrays.

Kept line-for-line equivalent to the Cython version; tests/ext/test_step_inputs.py proves equal output.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def build_step_inputs(
    token_lists: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    block_lists: Sequence[Sequence[int]],
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return input_ids, positions, slot_mapping (int64 [T]), query_start_loc (int32 [B+1]),
    seq_lens (int32 [B]) and block_tables (int32 [B, max_blocks], padded with block 0).

    A sequence's block table holds the blocks its positions reach, no more: its list may already
    hold blocks for tokens past this step (a lookahead), and the table's width must not depend on them."""
    num_seqs = len(token_lists)
    total = sum(len(tokens) for tokens in token_lists)
    needed = [-(-(start + len(tokens)) // block_size) for tokens, start in zip(token_lists, start_positions)]
    max_blocks = max(needed, default=0)
    input_ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    slot_mapping = np.empty(total, dtype=np.int64)
    query_start_loc = np.empty(num_seqs + 1, dtype=np.int32)
    seq_lens = np.empty(num_seqs, dtype=np.int32)
    block_tables = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int32)
    cursor = 0
    query_start_loc[0] = 0
    for b in range(num_seqs):
        tokens = token_lists[b]
        blocks = block_lists[b]
        start = start_positions[b]
        if start < 0 or len(blocks) * block_size < start + len(tokens):
            raise ValueError(f"sequence {b}: {len(blocks)} blocks cannot hold positions up to {start + len(tokens)}")
        for j in range(len(tokens)):
            pos = start + j
            input_ids[cursor] = tokens[j]
            positions[cursor] = pos
            slot_mapping[cursor] = blocks[pos // block_size] * block_size + pos % block_size
            cursor += 1
        query_start_loc[b + 1] = cursor
        seq_lens[b] = start + len(tokens)
        for j in range(needed[b]):
            block_tables[b, j] = blocks[j]
    return input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables
