"""One sample's place in its grammar, and the step's bitmask over the batch.

The decode (or prefill) stage records every token of a sample on its state; the device thread, and
only it, drives the matchers: while the forward runs on the device (the runner calls
`SamplingBatch.fill_grammar_bitmask` after launching it and before sampling) it gives each matcher
the tokens it is missing and fills the step's bitmask rows: one batched accept and one batched fill,
run in one GIL release (ext/grammar_step); then the logits pipeline masks disallowed tokens in one
call for the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

import ext
from pipeline.runner.host_staging import HostStaging

_bitmask = ext.load("bitmask")
_grammar_rows = ext.load("grammar_rows")
_grammar_step = ext.load("grammar_step")
_NO_ROWS = np.empty((0, 1), dtype=np.int32)


def refused_tokens(matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[int]:
    """Each matcher takes its token (one batched call, keeping the GIL); the indices of those that
    refused theirs (usually none: the bitmask allows only tokens the grammar accepts)."""
    return _grammar_step.accept_and_fill(_batch_matcher(pooled=False), matchers, tokens, [], _NO_ROWS, [], False)


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


@dataclass(slots=True)
class TokenRound:
    """A batched accept: states[i]'s matcher takes tokens[i] (the states' bookkeeping is done)."""

    states: list[GrammarState]
    tokens: list[int]

    @property
    def matchers(self) -> list[xgr.GrammarMatcher]:
        return [state.matcher for state in self.states]

    def refuse(self, indices: list[int]) -> None:
        for i in indices:
            self.states[i].refused = self.states[i].ended = True

    def take(self) -> None:
        """Give the round to the matchers now, on its own (one batched accept, keeping the GIL)."""
        self.refuse(refused_tokens(self.matchers, self.tokens))


def _next_round(rows: list[tuple[GrammarState, int, int | None]]) -> tuple[TokenRound, bool]:
    """The states still behind and the token each takes next; and whether any is behind by more."""
    states: list[GrammarState] = []
    tokens: list[int] = []
    more = False
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
        more = more or position - taken > 1
    return TokenRound(states, tokens), more


def take_tokens(rows: list[tuple[GrammarState, int, int | None]], keep_last: bool = False) -> TokenRound | None:
    """Bring each state's matcher to `position` output tokens: (state, position, the token at
    position - 1 when the stage may not have recorded it yet, else None). One batched accept per
    round; a state behind by k tokens needs k rounds (normally every state is behind by one).

    With keep_last the last round is booked but not given to the matchers: it is returned, for
    fill_batch_bitmask to give it in the same call as the fill (ext/grammar_step)."""
    while True:
        round_, more = _next_round(rows)
        if not round_.states:
            return None
        for state, token in zip(round_.states, round_.tokens):
            state.taken += 1
            state.ended = token in state.stop_ids
        if keep_last and not more:  # (a state refused in this round would take nothing later either)
            return round_
        round_.take()


def plan_rows(grammar_rows: list[tuple[int, GrammarState, int, int]],
              host: list[int]) -> tuple[TokenRound | None, list[tuple[int, GrammarState]]]:
    """A step's grammar work before its fill: (the last round of tokens to accept, kept for the fill;
    the (row, state) pairs to fill). grammar_rows: (row, state, previous row, output position being
    picked); host: the previous step's tokens, for rows one step ahead. A state that ended (its
    previous token was a stop token) drops its row: it allows everything. The usual step, every
    state behind by one token, is one compiled pass (ext/grammar_rows); any other, take_tokens."""
    planned = _grammar_rows.plan_step(grammar_rows, host, GrammarState, TokenRound)
    if planned is not None:
        return planned
    accepts = take_tokens([(state, position, host[previous] if previous >= 0 else None)
                           for _, state, previous, position in grammar_rows if isinstance(state, GrammarState)],
                          keep_last=True)
    return accepts, [(row, state) for row, state, _, _ in grammar_rows if not state.ended]


# Below this many rows the matchers fill on the calling thread, keeping the GIL: handing a few rows
# to xgrammar's thread pool and waiting for it, or giving the GIL up for microseconds of work and
# waiting to win it back from the event loop, costs more than their fill (host bench, batch 1).
BATCH_FILL_MIN_ROWS = 8


def _fill_rows(states: list[tuple[int, GrammarState]], tensor: torch.Tensor, array: np.ndarray, rows: list[int],
               accepts: TokenRound | None) -> None:
    if all(isinstance(state, GrammarState) for _, state in states):
        many = len(states) >= BATCH_FILL_MIN_ROWS
        refused = _grammar_step.accept_and_fill(_batch_matcher(pooled=many), accepts.matchers if accepts else [],
                                                accepts.tokens if accepts else [],
                                                [state.matcher for _, state in states], array, rows, many)
        if refused:  # (only a bug lets the mask allow a refused token) those rows allow everything
            assert accepts is not None
            accepts.refuse(refused)
            for row, state in states:
                if state.refused:
                    array[row] = -1
        return
    if accepts is not None:  # test doubles: objects with fill(tensor, row)
        accepts.take()
    for row, state in states:
        state.fill(tensor, row)


_BATCH: dict[bool, xgr.BatchGrammarMatcher] = {}


def _batch_matcher(pooled: bool) -> xgr.BatchGrammarMatcher:
    """xgrammar's batch filler, made once: with its own thread pool, or filling on the caller's."""
    if pooled not in _BATCH:
        _BATCH[pooled] = xgr.BatchGrammarMatcher(max_threads="auto" if pooled else 1)
    return _BATCH[pooled]


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_draft_rows(array: np.ndarray, tensor: torch.Tensor,
                    draft_rows: list[tuple[int, GrammarState, tuple[int, ...]]]) -> None:
    """Speculative verify rows after drafts (their state's row before the drafts is filled already, its matcher
    at that position): each matcher takes the drafts in order, fills the row after each, and is rolled back to
    where it was. Past a draft it refuses, or a stop token, the rows get the last mask it could fill, or allow
    everything: their positions are rejected anyway (the token picked there differs from the draft)."""
    by_state: dict[int, tuple[GrammarState, list[tuple[int, int, tuple[int, ...]]]]] = {}
    for row, state, drafts in draft_rows:
        by_state.setdefault(id(state), (state, []))[1].append((len(drafts), row, drafts))
    for state, rows in by_state.values():
        matcher, taken, stuck = state.matcher, 0, state.ended or state.refused
        for count, row, drafts in sorted(rows):
            if not stuck and taken < count:
                stuck = not matcher.accept_token(drafts[count - 1])
                taken += not stuck
            if state.ended or matcher.is_terminated():
                array[row] = -1
            else:
                matcher.fill_next_token_bitmask(tensor, row)
        if taken:
            matcher.rollback(taken)


def fill_batch_bitmask(states: list[tuple[int, GrammarState]], num_rows: int, vocab_size: int,
                       device: torch.device, staging: HostStaging | None = None,
                       accepts: TokenRound | None = None,
                       draft_rows: list[tuple[int, GrammarState, tuple[int, ...]]] = ()) -> torch.Tensor:
    """The step's int32 bitmask [S, ceil(V/32)] (bit j of word w allows token 32w + j) on `device`.

    Rows without a grammar allow everything. `accepts` (take_tokens' last round, kept) is given to
    the matchers first, in the same GIL release as the fill. With a runner's `staging` the host buffer and its
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
    _bitmask.fill_batch_bitmask(array, [row for row, _ in states], lambda rows: _fill_rows(states, host, array, rows, accepts))
    if accepts is not None and not states:  # no row to fill: the accepts alone
        accepts.take()
    if draft_rows:
        fill_draft_rows(array, host, draft_rows)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [S, V]: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
