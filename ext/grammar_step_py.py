"""Twin of ext/grammar_step.pyx: the same two batched calls through xgrammar's Python API (each of
them gives up the GIL on its own, which is what the compiled module avoids)."""
from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr


def accept_and_fill(batch: xgr.BatchGrammarMatcher, accept: list[xgr.GrammarMatcher], tokens: list[int],
                    fill: list[xgr.GrammarMatcher], bitmask: np.ndarray, rows: list[int],
                    release_gil: bool = True) -> list[int]:
    """accept[i] takes tokens[i]; then fill[i] writes its next-token mask into bitmask row rows[i].
    Returns the indices into `accept` of the matchers that refused their token (they keep their
    state, and their rows are filled from it). Raises RuntimeError when xgrammar does.
    release_gil: the compiled module's choice; xgrammar's Python calls release it either way."""
    if len(tokens) != len(accept) or len(rows) != len(fill):
        raise ValueError("accept_and_fill needs one token per accepting matcher and one row per filling matcher")
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags.c_contiguous:
        raise ValueError("the bitmask must be a C-contiguous int32 matrix")
    num_rows = bitmask.shape[0]
    for row in rows:
        if not 0 <= row < num_rows:
            raise IndexError(f"grammar row {row} is outside the bitmask's {num_rows} rows")
    try:
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(accept, tokens) if accept else []
        if fill:
            batch.batch_fill_next_token_bitmask(fill, torch.from_numpy(bitmask), rows)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise RuntimeError(str(exc)) from exc
    return [i for i, ok in enumerate(accepted) if not ok]
