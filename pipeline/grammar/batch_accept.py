"""A step's grammar accepts as one xgrammar call.

xgrammar's calls go through tvm-ffi, which releases the GIL around every call. For a per-token
accept (about 1.5 us of work) the release is the expensive part while the event loop wants the GIL:
each call hands the GIL over and waits to get it back. Measured on the 2-core host with a busy
second thread: 12 us of CPU and ~100 us of wall per accept, against 1.5 us alone; at batch 256 that
was 3 ms of device-thread CPU per step. So a step's accepts go to xgrammar as one batch call (the
GIL is released once, for the whole C++ loop), and its result is checked with one call that keeps
the GIL (reading the result element by element would be one released-GIL call per element).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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


def refused_tokens(matchers: Sequence[xgr.GrammarMatcher], tokens: Sequence[int]) -> list[int]:
    """Each matcher takes its token; the indices of those that refused theirs (usually none: the
    bitmask allows only tokens the grammar accepts)."""
    if not matchers:
        return []
    if _BY_HANDLE is not None:
        accept, contains = _BY_HANDLE
        result = accept([m._handle for m in matchers], list(tokens), False)
        if not contains(result, 0):
            return []
        accepted = list(result)  # rare: one call per element
    else:
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(list(matchers), list(tokens))
    return [i for i, ok in enumerate(accepted) if not ok]
