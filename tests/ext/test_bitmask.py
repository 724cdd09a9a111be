"""Batch bitmask assembly: compiled == twin; rows without a grammar allow everything, grammar rows
are left to `fill` (which writes every word of them)."""
import numpy as np
import pytest

from tests.ext.twins import twin_and_compiled

MODULES = twin_and_compiled("bitmask")
WORDS = {0: [9, 9, 9], 1: [1, 0, 5], 3: [0, -2, 7], 5: [3, 3, 3]}


def filler(bitmask):
    """The grammar's fill: writes every word of its rows (through the caller's view of the buffer)."""
    def fill(rows):
        for row in rows:
            bitmask[row] = WORDS[row]
    return fill


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("rows", [[1, 3], [0, 1, 3, 5], [3, 1], [], [5], [0]])
def test_assembly(module, rows):
    bitmask = np.zeros((6, 3), dtype=np.int32)
    module.fill_batch_bitmask(bitmask, rows, filler(bitmask))
    assert bitmask.tolist() == [WORDS[r] if r in rows else [-1, -1, -1] for r in range(6)]


@pytest.mark.parametrize("module", MODULES)
def test_bad_buffers_and_rows(module):
    with pytest.raises(ValueError):
        module.fill_batch_bitmask(np.zeros((3, 4), dtype=np.int32).T, [], filler(None))
    for row in (2, -1):
        with pytest.raises(IndexError):
            module.fill_batch_bitmask(np.zeros((2, 3), dtype=np.int32), [row], filler(None))
