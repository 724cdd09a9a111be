"""Grammar states on a tiny vocabulary: the device thread's batched catch-up gives every matcher the
same tokens, in the same order, as feeding each one token by token would."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import xgrammar as xgr

from kernels.triton_bitmask import unpack_bitmask
from pipeline.grammar.mask import fill_grammar_mask
from pipeline.grammar.state import GrammarState, refused_tokens, take_tokens
from pipeline.runner.host_staging import HostStaging

VOCAB = ["a", "b", "c", "ab", "bc", "x", "<eos>"]
EOS = 6
A, B, C, AB, BC, X = range(6)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def compiled() -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_regex("(a|b)+c")


def row_sets(mask, num_rows: int) -> list[set[int]]:
    """Each batch row's allowed tokens under a step's mask (None: every row allows everything)."""
    if mask is None:
        return [set(range(len(VOCAB))) for _ in range(num_rows)]
    grid = mask.allowed(num_rows, len(VOCAB))
    return [{t for t in range(len(VOCAB)) if grid[r, t]} for r in range(num_rows)]


def allowed(states: list[tuple[int, GrammarState]], num_rows: int,
            staging: HostStaging | None = None) -> list[set[int]]:
    return row_sets(fill_grammar_mask(states, len(VOCAB), CPU, staging), num_rows)


def reference(compiled: xgr.CompiledGrammar, tokens: list[int]) -> set[int]:
    matcher = xgr.GrammarMatcher(compiled)
    for token in tokens:
        assert matcher.accept_token(token)
    mask = torch.zeros((1, 1), dtype=torch.int32)
    matcher.fill_next_token_bitmask(mask)
    return {t for t in range(len(VOCAB)) if unpack_bitmask(mask, len(VOCAB))[0, t]}


def test_catch_up_from_recorded_and_ahead_tokens(compiled):
    behind = GrammarState(compiled)  # the stage recorded three tokens the matcher has not taken
    for token in (A, B, AB):
        assert not behind.record(token)
    ahead = GrammarState(compiled)  # one recorded; the next still on its way (the previous step's row)
    ahead.record(B)
    fresh = GrammarState(compiled)
    take_tokens([(behind, 3, None), (ahead, 2, A), (fresh, 0, None)])
    assert (behind.taken, ahead.taken, fresh.taken) == (3, 2, 0)
    assert not any(s.ended or s.refused for s in (behind, ahead, fresh))
    rows = allowed([(0, behind), (2, ahead), (3, fresh)], 4)
    assert rows == [reference(compiled, [A, B, AB]), set(range(len(VOCAB))),  # row 1 has no grammar
                    reference(compiled, [B, A]), reference(compiled, [])]
    assert rows[0] == {A, B, C, AB, BC}
    take_tokens([(ahead, 2, X)])  # taken already: nothing happens, whatever the token
    assert ahead.taken == 2 and not ahead.refused


@pytest.mark.parametrize("num_rows", [4, 12])  # one by one, and through xgrammar's batch fill
def test_a_bitmask_staged_over_an_earlier_steps_equals_a_fresh_one(compiled, num_rows):
    states = [GrammarState(compiled) for _ in range(num_rows)]
    for i, state in enumerate(states):
        for token in [A, B, AB][:i % 4]:
            state.record(token)
    take_tokens([(state, i % 4, None) for i, state in enumerate(states)])
    staging = HostStaging()
    fill_grammar_mask(list(enumerate(states)), len(VOCAB), CPU, staging)  # an earlier, larger step
    odd = [(row, state) for row, state in enumerate(states) if row % 2]
    staging.host_buffer("grammar_mask", np.int32, 2 * num_rows, CPU)[:] = 0  # stale words the fill must overwrite
    assert allowed(odd, num_rows, staging) == allowed(odd, num_rows)


def test_a_stop_token_ends_the_state_and_its_row_allows_everything(compiled):
    state = GrammarState(compiled)
    for token in (A, C):
        assert not state.record(token)
    assert state.record(EOS)  # the stage ends the sample at a stop token without asking the matcher
    take_tokens([(state, 3, None)])
    assert state.ended and not state.refused
    rows = [(0, s) for s in [state] if not s.ended]
    assert allowed(rows, 1) == [set(range(len(VOCAB)))]


def test_a_refused_token_is_seen_by_the_next_record(compiled):
    state, other = GrammarState(compiled), GrammarState(compiled)
    state.record(X)  # the mask never allows x here; only a bug could record it
    other.record(A)
    take_tokens([(state, 1, None), (other, 2, B)])
    assert state.refused and state.ended and not other.refused
    assert state.record(A)  # ends the sample
    take_tokens([(state, 2, None)])  # an ended state takes nothing more
    assert state.taken == 1


def test_a_token_the_stage_has_not_recorded_is_an_error(compiled):
    state = GrammarState(compiled)
    with pytest.raises(ValueError, match="grammar token 0"):
        take_tokens([(state, 1, None)])


def test_batched_accepts_equal_one_by_one(compiled):
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, len(VOCAB), 6).tolist() for _ in range(40)]
    batched = [xgr.GrammarMatcher(compiled) for _ in sequences]
    single = [xgr.GrammarMatcher(compiled) for _ in sequences]
    for step in range(6):
        tokens = [seq[step] for seq in sequences]
        refused = refused_tokens(batched, tokens)
        assert refused == [i for i, (m, t) in enumerate(zip(single, tokens)) if not m.accept_token(t)]
    assert refused_tokens([], []) == []


def test_the_last_round_is_kept_for_the_fill_and_equals_taking_it_first(compiled):
    def states() -> list[GrammarState]:
        made = [GrammarState(compiled) for _ in range(10)]
        for i, state in enumerate(made):
            for token in [A, B, AB][: i % 3]:
                state.record(token)
        return made

    plain, kept = states(), states()
    rows = lambda made: [(state, i % 3 + 1, [B, A, X][i % 3]) for i, state in enumerate(made)]  # noqa: E731
    take_tokens(rows(plain))
    accepts = take_tokens(rows(kept), keep_last=True)
    # behind by up to 3 tokens: the earlier rounds ran, the last (the states behind by 3) is kept
    assert accepts is not None and accepts.states == [kept[2], kept[5], kept[8]] and accepts.tokens == [X] * 3
    assert [s.taken for s in kept] == [s.taken for s in plain] and not any(s.refused for s in kept)
    filled = [(row, state) for row, state in enumerate(kept) if not state.ended]
    expected = allowed([(row, state) for row, state in enumerate(plain) if not state.ended], 10)
    assert all(plain[i].refused for i in (2, 5, 8))  # x after a, b, ab is refused
    mask = fill_grammar_mask(filled, len(VOCAB), CPU, accepts=accepts)
    assert [s.refused for s in kept] == [s.refused for s in plain]
    assert row_sets(mask, 10) == expected
    assert expected[2] == set(range(len(VOCAB)))  # a refused state's row allows everything


def test_kept_accepts_are_taken_when_no_row_is_filled(compiled):
    state = GrammarState(compiled)
    state.record(A)
    accepts = take_tokens([(state, 2, X)], keep_last=True)
    assert accepts is not None and not state.refused and state.taken == 2
    fill_grammar_mask([], len(VOCAB), CPU, accepts=accepts)
    assert state.refused and state.ended
    assert take_tokens([(state, 2, None)], keep_last=True) is None  # caught up: nothing to keep
