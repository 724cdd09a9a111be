"""One sample's place in its grammar, and the step's bitmask over the batch.

The decode (or prefill) stage advances a sample's state with every token it records; the device
thread fills the next step's bitmask rows from those states while the forward runs on the device
(the runner calls `fill_batch_bitmask` after launching the forward and before sampling), then the
logits pipeline masks disallowed tokens in one call for the whole batch.
"""
from __future__ import annotations

import threading

import numpy as np
import torch
import xgrammar as xgr

import ext

_bitmask = ext.load("bitmask")


class GrammarState:
    """Two threads advance it: the stage when it records a token, and the device thread when a step
    one step ahead needs the mask after a token the stage has not recorded yet. Tokens are taken by
    output position under a lock, so each is taken exactly once, by whichever thread comes first."""

    __slots__ = ("matcher", "_lock", "_taken", "_ok", "_stop_ids", "_terminated")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self._lock = threading.Lock()
        self._taken = 0  # output tokens taken so far
        self._ok = True  # every token taken was allowed
        self._stop_ids = frozenset(compiled.tokenizer_info.stop_token_ids)
        self._terminated = False

    def accept_at(self, position: int, token_id: int) -> bool:
        """Take the output token at `position` (once: a second call for it returns the first's answer);
        False if the grammar refused it (the mask makes that impossible) or an earlier one."""
        with self._lock:
            if position == self._taken:
                self._ok = self._ok and bool(self.matcher.accept_token(token_id))
                self._taken += 1
                if token_id in self._stop_ids:  # only a stop token ends a matcher (it is asked per token)
                    self._terminated = bool(self.matcher.is_terminated())
            elif position > self._taken:
                raise ValueError(f"grammar token {position} taken before token {self._taken}")
            return self._ok

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may be generated."""
        return self._terminated

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


# Below this many rows the matchers fill one by one on the calling thread: handing a few rows to
# xgrammar's thread pool and waiting for it costs more than their fill (host bench, batch 1).
BATCH_FILL_MIN_ROWS = 8


def _fill_rows(states: list[tuple[int, GrammarState]], tensor: torch.Tensor, rows: list[int]) -> None:
    if len(states) >= BATCH_FILL_MIN_ROWS and all(isinstance(state, GrammarState) for _, state in states):
        _batch_matcher().batch_fill_next_token_bitmask([state.matcher for _, state in states], tensor, rows)
    else:  # any object with fill(tensor, row) (tests)
        for row, state in states:
            state.fill(tensor, row)


_BATCH: list[xgr.BatchGrammarMatcher] = []


def _batch_matcher() -> xgr.BatchGrammarMatcher:
    """xgrammar's batch filler (its own thread pool), made once."""
    if not _BATCH:
        _BATCH.append(xgr.BatchGrammarMatcher(max_threads="auto"))
    return _BATCH[0]


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_batch_bitmask(states: list[tuple[int, GrammarState]], num_rows: int, vocab_size: int,
                       device: torch.device) -> torch.Tensor:
    """The step's int32 bitmask [S, ceil(V/32)] (bit j of word w allows token 32w + j) on `device`.

    Rows without a grammar allow everything. Filled in pinned memory on CUDA and copied without
    blocking, so it never waits behind the step's kernels.
    """
    array = np.empty((num_rows, bitmask_words(vocab_size)), dtype=np.int32)
    _bitmask.fill_batch_bitmask(array, [row for row, _ in states], lambda tensor, rows: _fill_rows(states, tensor, rows))
    host = torch.from_numpy(array)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [S, V]: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
