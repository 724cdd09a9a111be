"""One sample's place in its grammar.

The decode (or prefill) stage records every token of a sample on its state; the device thread, and
only it, drives the matchers: while the forward runs on the device (the runner calls
`SamplingBatch.fill_grammar_bitmask` after launching it and before sampling) it gives each matcher
the tokens it is missing and fills the step's bitmask rows (pipeline/grammar/mask.py): one batched
accept and one batched fill, run in one GIL release (ext/grammar_step); then the logits pipeline
masks the refused tokens in one call for the whole batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

import ext
from pipeline.cpu_threads import usable_cores

_grammar_rows = ext.load("grammar_rows")
_grammar_step = ext.load("grammar_step")
_NO_ROWS = np.empty((0, 1), dtype=np.int32)


_BATCH: dict[bool, xgr.BatchGrammarMatcher] = {}


def fill_threads() -> int:
    """xgrammar's batch fill threads: half the cores this process may use, as xgrammar's own "auto" takes half of
    the machine's (whatever the affinity mask or a cgroup quota leaves this process)."""
    return max(1, usable_cores() // 2)


def batch_matcher(pooled: bool) -> xgr.BatchGrammarMatcher:
    """xgrammar's batch filler, made once: with its own thread pool, or filling on the caller's."""
    if pooled not in _BATCH:
        _BATCH[pooled] = xgr.BatchGrammarMatcher(max_threads=fill_threads() if pooled else 1)
    return _BATCH[pooled]


def refused_tokens(matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[int]:
    """Each matcher takes its token (one batched call, keeping the GIL); the indices of those that
    refused theirs (usually none: the bitmask allows only tokens the grammar accepts)."""
    return _grammar_step.accept_and_fill(batch_matcher(pooled=False), matchers, tokens, [], _NO_ROWS, [], False)


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
    fill_grammar_mask (pipeline/grammar/mask.py) to give it in the same call as the fill (ext/grammar_step)."""
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
