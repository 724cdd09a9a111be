"""A step's grammar mask (pipeline/grammar/mask.py) on tiny vocabularies: one bitmask row per constrained row, the
rows that allow everything dropped (a tool grammar before its trigger costs the device nothing), and the rows after
speculative drafts masked as their matcher allows after the drafts, the matcher rolled back after."""
from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from pipeline.grammar.mask import fill_grammar_mask
from pipeline.grammar.state import GrammarState, take_tokens
from pipeline.request import SamplingParams
from pipeline.runner.host_staging import HostStaging
from pipeline.runner.logits_pipeline import apply_logits_pipeline, changes_logits
from pipeline.runner.sampling_batch import SamplingBatch, SamplingRow

CPU = torch.device("cpu")
TAG_VOCAB = ["a", "b", "<t>", "{", "}", '"', "x", "</t>", "<eos>", "<", "t>"]
A, B, TRIGGER, OPEN, LT, T_GT = 0, 1, 2, 3, 9, 10
REGEX_VOCAB = ["a", "b", "c", "ab", "bc", "x", "<eos>"]


def compiled_tag() -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo(TAG_VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[8])
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<t>"], "tags": [
        {"type": "tag", "begin": "<t>", "content": {"type": "json_schema", "json_schema": {"type": "object"}},
         "end": "</t>"}], "at_least_one": False, "stop_after_first": False}}
    return xgr.GrammarCompiler(info).compile_structural_tag(json.dumps(tag))


def state_after(compiled: xgr.CompiledGrammar, tokens: list[int]) -> GrammarState:
    state = GrammarState(compiled)
    for token in tokens:
        state.record(token)
    take_tokens([(state, len(tokens), None)])
    return state


def reference(compiled: xgr.CompiledGrammar, tokens: list[int], vocab: int) -> set[int]:
    matcher = xgr.GrammarMatcher(compiled)
    for token in tokens:
        assert matcher.accept_token(token)
    words = torch.zeros((1, 1), dtype=torch.int32)
    matcher.fill_next_token_bitmask(words)
    return {t for t in range(vocab) if int(words[0, 0]) >> t & 1}


def sets(mask, num_rows: int, vocab: int) -> list[set[int]]:
    grid = mask.allowed(num_rows, vocab)
    return [{t for t in range(vocab) if grid[r, t]} for r in range(num_rows)]


@pytest.mark.parametrize("staged", [False, True])
def test_a_tool_grammar_before_its_trigger_is_dropped_from_the_mask(staged):
    compiled = compiled_tag()
    free, triggered = state_after(compiled, [A, B]), state_after(compiled, [A, LT, T_GT])  # "<" "t>": the trigger
    staging = HostStaging() if staged else None
    mask = fill_grammar_mask([(0, free), (3, triggered)], len(TAG_VOCAB), CPU, staging)
    assert mask is not None and mask.host_rows.tolist() == [3] and mask.host_slots.tolist() == [0]
    assert mask.bitmask.shape == (1, 1) and mask.rows.tolist() == [3]  # the free row is not sent
    everything = set(range(len(TAG_VOCAB)))
    assert sets(mask, 4, len(TAG_VOCAB)) == [everything, everything, everything, {OPEN}]
    assert fill_grammar_mask([(0, free), (1, state_after(compiled, []))], len(TAG_VOCAB), CPU, staging) is None


def test_a_batch_whose_grammar_rows_allow_everything_leaves_the_logits_alone():
    compiled = compiled_tag()
    rows = [SamplingRow(SamplingParams(temperature=0.0), (), (), frozenset(), 0, 2, state_after(compiled, [A, B])),
            SamplingRow(SamplingParams(temperature=0.0), (), (), frozenset(), 1, 0)]
    batch = SamplingBatch.from_rows(rows, len(TAG_VOCAB), CPU)
    batch.fill_grammar_bitmask()
    logits = torch.randn(2, len(TAG_VOCAB))
    assert batch.grammar_mask is None and not changes_logits(batch)
    assert apply_logits_pipeline(logits, batch) is logits  # no copy, no masking


def test_rows_after_drafts_are_masked_as_after_the_drafts_and_the_matcher_rolls_back():
    info = xgr.TokenizerInfo(REGEX_VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[6])
    compiled = xgr.GrammarCompiler(info).compile_regex("(a|b)+c")
    a, b, c, x = 0, 1, 2, 5
    state, other = state_after(compiled, [a]), state_after(compiled, [b, b])
    vocab = len(REGEX_VOCAB)
    # one sequence's rows: before its drafts (batch row 1), after one and two drafts (rows 2, 3); another's after a
    # draft its grammar refuses and one past it (rows 5, 6: rejected anyway, they get the last mask it could fill)
    mask = fill_grammar_mask([(1, state), (4, other)], vocab, CPU, None, None,
                             [(2, state, (b,)), (3, state, (b, c)), (5, other, (x,)), (6, other, (x, a))])
    assert mask is not None
    got = sets(mask, 7, vocab)
    assert got[1] == reference(compiled, [a], vocab) and got[2] == reference(compiled, [a, b], vocab)
    assert got[3] == reference(compiled, [a, b, c], vocab) == {6}
    assert got[5] == got[6] == got[4] == reference(compiled, [b, b], vocab) and got[0] == set(range(vocab))
    again = fill_grammar_mask([(0, state), (1, other)], vocab, CPU)  # rolled back: the rows before the drafts
    assert again is not None and sets(again, 2, vocab) == [got[1], got[4]]
    assert not state.refused and not other.refused
