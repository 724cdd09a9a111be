"""Twin of ext/grammar_step.pyx: the same two batched calls through xgrammar's Python bindings.

xgrammar's calls go through tvm-ffi, which releases the GIL around every call. For a small call the
release is the expensive part while the event loop wants the GIL: each call hands the GIL over and
waits to get it back (measured on the 2-core host with a busy second thread: 12 us of CPU and ~100 us
of wall per single-token accept, against 1.5 us alone). So the accept goes to xgrammar as one batch
call through our own handle of its function with the GIL kept, and its result is checked with one
call that keeps the GIL (xgrammar's public wrapper reads the result element by element: one
released-GIL call per element). The fill releases the GIL once, as xgrammar's binding does.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import xgrammar as xgr


def _batch_accept_by_handle() -> tuple[Callable[..., Any], Callable[[Any, int], bool]] | None:
    """xgrammar's batch accept over matcher handles, and an `ffi.ArrayContains` that keeps the GIL;
    None when this xgrammar has no tvm-ffi core (then the public batch call is used)."""
    try:
        import tvm_ffi
        from xgrammar.base import _core

        # our own handles of both functions (a round trip through an FFI array makes a new Python
        # object for the same function), so setting their GIL flag changes nothing for xgrammar
        accept = tvm_ffi.Array([_core.BatchGrammarMatcher.batch_accept_token])[0]
        contains = tvm_ffi.get_global_func("ffi.ArrayContains")
        accept.release_gil = contains.release_gil = False
    except (ImportError, AttributeError, ValueError, RuntimeError):
        return None
    return accept, contains


_BY_HANDLE = _batch_accept_by_handle()


def _refused(matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[int]:
    if not matchers:
        return []
    if _BY_HANDLE is not None:
        accept, contains = _BY_HANDLE
        result = accept([m._handle for m in matchers], list(tokens), False)
        if not contains(result, 0):
            return []
        accepted = list(result)  # rare (only a bug lets the mask allow a refused token): per element
    else:
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(list(matchers), list(tokens))
    return [i for i, ok in enumerate(accepted) if not ok]


def accept_and_fill(batch: xgr.BatchGrammarMatcher, accept: list[xgr.GrammarMatcher], tokens: list[int],
                    fill: list[xgr.GrammarMatcher], bitmask: np.ndarray, rows: list[int],
                    release_gil: bool = True) -> list[int]:
    """accept[i] takes tokens[i]; then fill[i] writes its next-token mask into bitmask row rows[i].
    Returns the indices into `accept` of the matchers that refused their token (they keep their
    state, and their rows are filled from it). Raises RuntimeError when xgrammar does.
    release_gil: the compiled module's choice (here the accept keeps it and the fill releases it)."""
    if len(tokens) != len(accept) or len(rows) != len(fill):
        raise ValueError("accept_and_fill needs one token per accepting matcher and one row per filling matcher")
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags.c_contiguous:
        raise ValueError("the bitmask must be a C-contiguous int32 matrix")
    num_rows = bitmask.shape[0]
    for row in rows:
        if not 0 <= row < num_rows:
            raise IndexError(f"grammar row {row} is outside the bitmask's {num_rows} rows")
    try:
        refused = _refused(accept, tokens)
        if fill:
            batch.batch_fill_next_token_bitmask(fill, bitmask, rows)  # numpy as is: no torch call per step
    except (RuntimeError, ValueError, TypeError) as exc:
        raise RuntimeError(str(exc)) from exc
    return refused
