"""The n-gram drafter's search: compiled == twin == a brute-force definition."""
import random

import numpy as np
import pytest

from tests.ext.twins import twin_and_compiled

MODULES = twin_and_compiled("ngram")


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix of min_n..max_n tokens that occurred before (ending before the last token), its latest
    occurrence, the up to k tokens after that."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def call(module, tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    buffer = np.zeros(len(tokens) + 5, dtype=np.int64)  # a history buffer longer than the history
    buffer[:len(tokens)] = tokens
    return module.propose(buffer, len(tokens), k, min_n, max_n)


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("seed", range(40))
def test_equals_brute_force(module, seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 50])
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 300))]
    for k, min_n, max_n in ((4, 1, 3), (8, 2, 5), (1, 3, 3), (16, 1, 8)):
        assert call(module, tokens, k, min_n, max_n) == brute_force(tokens, k, min_n, max_n)


@pytest.mark.parametrize("module", MODULES)
def test_cases(module):
    code = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert call(module, code, 3, 1, 3) == [8, 9, 1]  # "5 6 7" recurs: what followed it
    assert call(module, code, 10, 1, 3) == [8, 9, 1, 2, 5, 6, 7]  # up to the end of the history
    assert call(module, code, 3, 4, 5) == []  # no suffix of 4 recurs
    assert call(module, [1, 2, 1, 3, 1], 2, 1, 2) == [3, 1]  # the latest of two single-token matches
    assert call(module, [4, 4, 4, 4], 3, 1, 2) == [4]  # overlapping its own suffix
    assert call(module, [], 3, 1, 2) == [] and call(module, [1], 3, 1, 2) == []
    assert call(module, code, 0, 1, 3) == []


def test_compiled_refuses_a_length_past_the_buffer():
    compiled = next(p.values[0] for p in MODULES if p.id == "compiled")
    if compiled is None:
        pytest.skip("not built")
    with pytest.raises(ValueError):
        compiled.propose(np.zeros(3, dtype=np.int64), 4, 2, 1, 2)
