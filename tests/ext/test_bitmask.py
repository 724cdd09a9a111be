"""A step's grammar bitmask on the host: compiled == twin == the torch reference (kernels/triton_bitmask.py). Rows
that allow every token below the vocabulary size are found (bits past it do not count); masking writes -inf where a
row's bitmask refuses a token and touches nothing else."""
import numpy as np
import pytest
import torch

from kernels.triton_bitmask import apply_token_bitmask_ref
from tests.ext.twins import twin_and_compiled

MODULES = twin_and_compiled("bitmask")


def bitmask_of(allowed: list[set[int]], vocab: int) -> np.ndarray:
    words = np.zeros((len(allowed), (vocab + 31) // 32), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token >> 5] |= np.uint32(1) << np.uint32(token & 31)
    return words.view(np.int32)


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("vocab", [32, 45, 100])
def test_masking_rows_are_those_refusing_a_token(module, vocab):
    everything = set(range(vocab))
    allowed = [everything, everything - {vocab - 1}, {0}, everything - {0}, set(), everything]
    bitmask = bitmask_of(allowed, vocab)  # row 5: the bits past the vocabulary unset
    bitmask[0, -1] = -1  # row 0: set
    assert module.masking_rows(bitmask, len(allowed), vocab) == [1, 2, 3, 4]
    assert module.masking_rows(bitmask, 1, vocab) == []
    assert module.masking_rows(bitmask, 0, vocab) == []


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("vocab", [5, 32, 33, 1000])
def test_apply_equals_the_reference(module, vocab):
    rng = np.random.default_rng(vocab)
    bitmask = rng.integers(-2**31, 2**31, size=(4, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # allows everything: a no-op
    bitmask[2, : len(bitmask[2]) // 2] = 0  # whole words refused
    logits = rng.standard_normal((6, vocab)).astype(np.float32)
    rows, slots = np.array([5, 0, 3, 2], dtype=np.int32), np.array([0, 1, 2, 3], dtype=np.int32)
    expected = apply_token_bitmask_ref(torch.from_numpy(logits.copy()), torch.from_numpy(bitmask),
                                       torch.from_numpy(rows), torch.from_numpy(slots))
    module.apply_bitmask(logits, bitmask, rows, slots)
    assert torch.equal(torch.from_numpy(logits), expected)
    assert np.isfinite(logits[[1, 4]]).all() and np.isfinite(logits[0]).all()  # rows not named, and slot 1


@pytest.mark.parametrize("module", MODULES)
def test_bad_arguments(module):
    logits, bitmask = np.zeros((2, 40), dtype=np.float32), np.zeros((1, 2), dtype=np.int32)
    one = np.array([0], dtype=np.int32)
    with pytest.raises(IndexError):
        module.apply_bitmask(logits, bitmask, np.array([2], dtype=np.int32), one)
    with pytest.raises(IndexError):
        module.apply_bitmask(logits, bitmask, one, np.array([1], dtype=np.int32))
    with pytest.raises(ValueError):
        module.apply_bitmask(logits, bitmask, one, np.array([0, 0], dtype=np.int32))
    with pytest.raises(ValueError):
        module.apply_bitmask(np.zeros((2, 80), dtype=np.float32), bitmask, one, one)  # 2 words: 64 tokens
    with pytest.raises(ValueError):
        module.masking_rows(bitmask, 1, 65)
    with pytest.raises(IndexError):
        module.masking_rows(bitmask, 2, 40)
