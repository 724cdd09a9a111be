"""A step's grammar work (batched accept, then batched fill): compiled == twin == xgrammar one matcher
at a time, on a tiny vocabulary; refusals keep the matcher's state; bad input raises."""
import numpy as np
import pytest
import torch
import xgrammar as xgr

from ext import grammar_step_py
from tests.ext.twins import twin_and_compiled

MODULES = twin_and_compiled("grammar_step")
VOCAB = ["a", "b", "c", "ab", "bc", "x", "<eos>"]
EOS = 6
X = 5


@pytest.fixture(scope="module")
def compiled() -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_regex("(a|b)+c(a|bc)*")


def one_by_one(matcher: xgr.GrammarMatcher) -> list[int]:
    row = torch.zeros((1, 1), dtype=torch.int32)
    matcher.fill_next_token_bitmask(row)
    return row[0].tolist()


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("threads, release_gil", [(1, False), (1, True), ("auto", True)])
def test_steps_equal_one_matcher_at_a_time(module, compiled, threads, release_gil):
    rng = np.random.default_rng(1)
    size = 24
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    ours = [xgr.GrammarMatcher(compiled) for _ in range(size)]
    reference = [xgr.GrammarMatcher(compiled) for _ in range(size)]
    for step in range(8):
        accepting = sorted(rng.choice(size, size // 2, replace=False).tolist()) if step else []
        tokens = rng.integers(0, len(VOCAB) - 1, len(accepting)).tolist()  # x is refused anywhere
        filling = rng.permutation(size)[: size - 3].tolist()
        rows = rng.permutation(size + 2)[: len(filling)].tolist()  # any rows, in any order
        bitmask = np.full((size + 2, 1), 7, dtype=np.int32)
        refused = module.accept_and_fill(batch, [ours[i] for i in accepting], tokens,
                                         [ours[i] for i in filling], bitmask, rows, release_gil)
        expected = [k for k, (i, t) in enumerate(zip(accepting, tokens)) if not reference[i].accept_token(t)]
        assert refused == expected
        for i, row in zip(filling, rows):
            assert bitmask[row].tolist() == one_by_one(reference[i])
        untouched = set(range(size + 2)) - set(rows)
        assert all(bitmask[row].tolist() == [7] for row in untouched)


@pytest.mark.parametrize("module", MODULES)
def test_a_refusing_matcher_keeps_its_state_and_is_filled_from_it(module, compiled):
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(2)]
    bitmask = np.zeros((2, 1), dtype=np.int32)
    assert module.accept_and_fill(xgr.BatchGrammarMatcher(1), matchers, [X, 0], matchers, bitmask, [0, 1]) == [0]
    fresh, after_a = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)
    after_a.accept_token(0)
    assert bitmask.tolist() == [one_by_one(fresh), one_by_one(after_a)]


@pytest.mark.parametrize("module", MODULES)
def test_nothing_to_do(module, compiled):
    bitmask = np.full((2, 1), 3, dtype=np.int32)
    assert module.accept_and_fill(xgr.BatchGrammarMatcher(1), [], [], [], bitmask, []) == []
    assert bitmask.tolist() == [[3], [3]]


@pytest.mark.parametrize("module", MODULES)
def test_bad_input_raises(module, compiled):
    batch, matcher = xgr.BatchGrammarMatcher(1), xgr.GrammarMatcher(compiled)
    bitmask = np.zeros((2, 1), dtype=np.int32)
    with pytest.raises(ValueError):
        module.accept_and_fill(batch, [matcher], [], [], bitmask, [])
    with pytest.raises(ValueError):
        module.accept_and_fill(batch, [], [], [matcher], bitmask, [])
    for row in (2, -1):
        with pytest.raises(IndexError):
            module.accept_and_fill(batch, [], [], [matcher], bitmask, [row])
    with pytest.raises(ValueError):
        module.accept_and_fill(batch, [], [], [matcher], np.zeros((4, 1), dtype=np.int32)[::2], [0])  # strided
    with pytest.raises(RuntimeError):  # xgrammar's own check: a row is ceil(V/32) words
        module.accept_and_fill(batch, [], [], [matcher], np.zeros((2, 3), dtype=np.int32), [0])
    assert module.accept_and_fill(batch, [matcher], [0], [], bitmask, []) == []  # still usable after


@pytest.mark.parametrize("by_handle", [True, False])
def test_the_twins_accept_by_handle_equals_xgrammars_public_call(compiled, monkeypatch, by_handle):
    if not by_handle:
        monkeypatch.setattr(grammar_step_py, "_BY_HANDLE", None)  # xgrammar's public batch call
    elif grammar_step_py._BY_HANDLE is None:
        pytest.skip("this xgrammar has no tvm-ffi core")
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, len(VOCAB), 6).tolist() for _ in range(40)]
    batched = [xgr.GrammarMatcher(compiled) for _ in sequences]
    single = [xgr.GrammarMatcher(compiled) for _ in sequences]
    none = np.zeros((0, 1), dtype=np.int32)
    for step in range(6):
        tokens = [seq[step] for seq in sequences]
        refused = grammar_step_py.accept_and_fill(xgr.BatchGrammarMatcher(1), batched, tokens, [], none, [])
        assert refused == [i for i, (m, t) in enumerate(zip(single, tokens)) if not m.accept_token(t)]


def test_the_twins_accept_keeps_the_gil_without_changing_xgrammar():
    if grammar_step_py._BY_HANDLE is None:
        pytest.skip("this xgrammar has no tvm-ffi core")
    from xgrammar.base import _core

    accept, contains = grammar_step_py._BY_HANDLE
    assert not accept.release_gil and not contains.release_gil
    assert _core.BatchGrammarMatcher.batch_accept_token.release_gil  # xgrammar's own handle is untouched
