"""Batch bitmask assembly: compiled == twin; rows without a grammar allow everything."""
import numpy as np
import pytest

from tests.ext.twins import twin_and_compiled

MODULES = twin_and_compiled("bitmask")
WORDS = {1: [1, 0, 5], 3: [0, -2, 7]}


def fill(tensor, rows):
    for row in rows:
        tensor[row] = tensor.new_tensor(WORDS[row])


@pytest.mark.parametrize("module", MODULES)
def test_assembly(module):
    bitmask = np.zeros((4, 3), dtype=np.int32)
    module.fill_batch_bitmask(bitmask, [1, 3], fill)
    assert bitmask.tolist() == [[-1, -1, -1], [1, 0, 5], [-1, -1, -1], [0, -2, 7]]
    module.fill_batch_bitmask(bitmask, [], fill)
    assert (bitmask == -1).all()
    with pytest.raises(ValueError):
        module.fill_batch_bitmask(np.zeros((3, 4), dtype=np.int32).T, [], fill)
