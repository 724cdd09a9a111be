"""Batch bitmask assembly: compiled == twin; rows without a grammar allow everything."""
import importlib

import numpy as np
import pytest

from ext import bitmask_py

try:
    compiled = importlib.import_module("ext.bitmask")
except ImportError:  # not built
    compiled = None

MODULES = [pytest.param(bitmask_py, id="twin"),
           pytest.param(compiled, id="compiled", marks=pytest.mark.skipif(compiled is None, reason="not built"))]


class Allow:
    def __init__(self, words: list[int]) -> None:
        self.words = words

    def fill(self, tensor, row: int) -> None:
        for i, word in enumerate(self.words):
            tensor[row, i] = word


@pytest.mark.parametrize("module", MODULES)
def test_assembly(module):
    bitmask = np.zeros((4, 3), dtype=np.int32)
    module.fill_batch_bitmask(bitmask, [(1, Allow([1, 0, 5])), (3, Allow([0, -2, 7]))])
    assert bitmask.tolist() == [[-1, -1, -1], [1, 0, 5], [-1, -1, -1], [0, -2, 7]]
    module.fill_batch_bitmask(bitmask, [])
    assert (bitmask == -1).all()
