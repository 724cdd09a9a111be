"""One sample's place in its grammar, and the step's bitmask over the batch.

The decode (or prefill) stage records every token of a sample on its state; the device thread, and
only it, drives the matchers: while the forward runs on the device (the runner calls
`SamplingBatch.fill_grammar_bitmask` after launching it and before sampling) it gives each matcher
the tokens it is missing and fills the step's bitmask rows, one batched call each; then the logits
pipeline masks disallowed tokens in one call for the whole batch.
"""
from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr

import ext
from pipeline.grammar.batch_accept import refused_tokens
from pipeline.runner.host_staging import HostStaging

_bitmask = ext.load("bitmask")


class GrammarState:
    """One sample's matcher. Only the device thread calls it: it takes the sample's tokens and fills
    its masks, a whole step's rows in one batched xgrammar call each, so the event loop never waits
    on a matcher, a lock, or a GIL hand-off per token. The stage only records tokens (`record`);
    the device thread catches the matcher up from those, or, for a row one step ahead, from the
    previous step's host tokens (`take_tokens`)."""

    __slots__ = ("matcher", "recorded", "taken", "refused", "ended", "stop_ids")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.recorded: list[int] = []  # the output tokens the stage recorded, in order (loop thread)
        self.taken = 0  # output tokens the matcher has been given (device thread)
        self.refused = False  # the matcher refused one of them (the mask makes that impossible)
        self.ended = False  # it took a stop token or refused one: it has no next mask
        self.stop_ids = frozenset(compiled.tokenizer_info.stop_token_ids)

    def record(self, token_id: int) -> bool:
        """The stage recorded the sample's next output token. True when the grammar ends the sample:
        the token is a stop token (the mask allows one only where the grammar is complete), or the
        matcher refused an earlier token (seen once the device thread took it)."""
        self.recorded.append(token_id)
        return token_id in self.stop_ids or self.refused

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def take_tokens(rows: list[tuple[GrammarState, int, int | None]]) -> None:
    """Bring each state's matcher to `position` output tokens: (state, position, the token at
    position - 1 when the stage may not have recorded it yet, else None). One batched accept per
    round; a state behind by k tokens needs k rounds (normally every state is behind by one)."""
    while True:
        states: list[GrammarState] = []
        tokens: list[int] = []
        for state, position, ahead in rows:
            taken = state.taken
            if taken >= position or state.ended:
                continue
            if ahead is not None and taken == position - 1:
                tokens.append(ahead)
            elif taken < len(state.recorded):
                tokens.append(state.recorded[taken])
            else:
                raise ValueError(f"grammar token {taken} is needed before the stage recorded it")
            states.append(state)
        if not states:
            return
        refused = refused_tokens([state.matcher for state in states], tokens)
        for state, token in zip(states, tokens):
            state.taken += 1
            state.ended = token in state.stop_ids
        for i in refused:
            states[i].refused = states[i].ended = True


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
                       device: torch.device, staging: HostStaging | None = None) -> torch.Tensor:
    """The step's int32 bitmask [S, ceil(V/32)] (bit j of word w allows token 32w + j) on `device`.

    Rows without a grammar allow everything. With a runner's `staging` the host buffer and its
    tensor view are the staging's, reused step after step (a fresh 1.5 MB array per step at batch
    256 is a fresh mapping whose every page faults on first write, and a fresh tensor is a torch
    call): on CPU the result is valid until the runner's next step, which samples before that; on
    CUDA it is copied through pinned memory without blocking, so it never waits behind the step's
    kernels.
    """
    words = bitmask_words(vocab_size)
    if staging is not None:
        array, host = staging.matrix("bitmask", np.int32, num_rows, words)
    else:
        array = np.empty((num_rows, words), dtype=np.int32)
        host = torch.from_numpy(array)
    _bitmask.fill_batch_bitmask(array, [row for row, _ in states], lambda rows: _fill_rows(states, host, rows))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [S, V]: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
