"""Penalty bookkeeping: compiled == twin == counting the token lists directly."""
import random
from collections import Counter

import numpy as np
import pytest

from tests.ext.twins import twin_and_compiled

MODULES = twin_and_compiled("penalties")


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("seed", range(10))
def test_sparse_inputs_equal_direct_counts(module, seed):
    rng = random.Random(seed)
    vocab = 50
    rows = []
    for row in range(rng.randint(1, 5)):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
        counts = module.TokenCounts(prompt)
        for token in output:  # incremental, as the engine appends
            counts.add(token)
        rows.append((row, prompt, output, counts))
    seen_rows = [(r, c) for r, _, _, c in rows if r % 2 == 0]
    counted_rows = [(r, c) for r, _, _, c in rows]
    seen, counted, values = module.penalty_inputs(seen_rows, counted_rows, vocab)
    expected_seen = sorted(r * vocab + t for r, p, o, _ in rows if r % 2 == 0 for t in set(p) | set(o))
    assert sorted(seen.tolist()) == expected_seen
    expected_counts = {r * vocab + t: n for r, _, o, _ in rows for t, n in Counter(o).items()}
    assert dict(zip(counted.tolist(), values.tolist())) == expected_counts
    assert seen.dtype == np.int64 and counted.dtype == np.int64 and values.dtype == np.float32


@pytest.mark.parametrize("module", MODULES)
def test_with_tokens_counts_drafts_without_touching_the_original(module):
    counts = module.TokenCounts([1, 2, 3])
    counts.add_all([4, 4, 5])
    draft = counts.with_tokens([4, 6])
    assert draft.output == {4: 3, 5: 1, 6: 1} and draft.prompt == {1, 2, 3}
    assert counts.output == {4: 2, 5: 1}  # the sequence's own counts unchanged
    _, counted, values = module.penalty_inputs([], [(0, draft)], 10)
    assert dict(zip(counted.tolist(), values.tolist())) == {4: 3.0, 5: 1.0, 6: 1.0}
