"""Pure-Python twin of ext/grammar_rows.pyx: a decode step's grammar bookkeeping, in one pass.

Each step the device thread brings every constrained row's matcher up to the row's position before
filling its mask (pipeline/grammar/state.py). Normally every state is behind by exactly one token,
the previous step's, so the general path's rounds (take_tokens) reduce to one: this plans it in one
pass over the rows, books it on the states, and lists the rows to fill. Anything else (a state behind
by more, a row whose state is not a GrammarState, a token not recorded yet) returns None before
booking anything, and the caller takes the general path, which handles it or raises.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def plan_step(grammar_rows: list[tuple[int, Any, int, int]], host: list[int], state_type: type,
              round_type: Callable[[list[Any], list[int]], Any]) -> tuple[Any, list[tuple[int, Any]]] | None:
    """grammar_rows: (row, state, previous row, output position being picked) as SamplingBatch keeps
    them; host: the previous step's tokens (a row one step ahead takes its token from there).
    Returns (round_type(states, tokens) of the tokens to accept with the fill, or None when no state
    takes one; the (row, state) pairs to fill: every state that did not end), or None (see above)."""
    states: list[Any] = []
    tokens: list[int] = []
    for _, state, previous, position in grammar_rows:
        if not isinstance(state, state_type):
            return None
        taken = state.taken
        if taken >= position or state.ended:
            continue
        if position - taken > 1:
            return None
        if previous >= 0 and taken == position - 1:
            token = host[previous]
        elif taken < len(state.recorded):
            token = state.recorded[taken]
        else:
            return None
        states.append(state)
        tokens.append(token)
    for state, token in zip(states, tokens):
        state.taken += 1
        state.ended = token in state.stop_ids
    fills = [(row, state) for row, state, _, _ in grammar_rows if not state.ended]
    return (round_type(states, tokens) if states else None), fills
