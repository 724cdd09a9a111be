"""The n-gram drafter over a sequence's growing token list (pipeline/spec/ngram.py)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.spec.ngram import NgramDrafter, TokenHistory


def test_history_grows_with_the_token_list():
    history, tokens = TokenHistory(), []
    for n in (0, 3, 3, 300, 1000):
        tokens.extend(range(len(tokens), n))
        history.sync(tokens)
        assert history.length == n and np.array_equal(history.buffer[:n], np.arange(n))


def test_drafts_follow_the_latest_recurring_suffix():
    seq = SimpleNamespace(token_ids=[5, 6, 7, 8, 9, 1, 2, 5, 6], draft_history=None)
    drafter = NgramDrafter(1, 3)
    assert drafter.propose(seq, 3) == [7, 8, 9]
    seq.token_ids += [7, 4, 5, 6]  # "5 6" recurs again; the latest occurrence is followed by 7 4
    assert drafter.propose(seq, 2) == [7, 4]
    assert NgramDrafter(3, 4).propose(SimpleNamespace(token_ids=[1, 2, 3, 1, 2], draft_history=None), 2) == []
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)
