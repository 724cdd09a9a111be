"""The compiled step-input builder and its pure-Python twin give equal arrays."""
import importlib
import random

import numpy as np
import pytest

from ext import step_inputs_py

try:
    compiled = importlib.import_module("ext.step_inputs")
except ImportError:  # not built (e.g. a checkout without `make install`)
    compiled = None


def random_step(rng: random.Random, block_size: int):
    tokens, starts, blocks = [], [], []
    free = list(range(1, 500))
    rng.shuffle(free)
    for _ in range(rng.randint(1, 12)):
        start = rng.randint(0, 60)
        count = rng.choice([1, 1, 1, rng.randint(1, 40)])
        needed = -(-(start + count) // block_size)
        tokens.append([rng.randint(0, 49151) for _ in range(count)])
        starts.append(start)
        blocks.append([free.pop() for _ in range(needed)])
    return tokens, starts, blocks


def test_twin_matches_a_direct_description():
    out = step_inputs_py.build_step_inputs([[5, 6, 7], [9]], [0, 5], [[3, 4], [8, 2]], 4)
    input_ids, positions, slots, qsl, lens, tables = out
    assert input_ids.tolist() == [5, 6, 7, 9]
    assert positions.tolist() == [0, 1, 2, 5]
    assert slots.tolist() == [12, 13, 14, 2 * 4 + 1]
    assert qsl.tolist() == [0, 3, 4] and lens.tolist() == [3, 6]
    assert tables.tolist() == [[3, 0], [8, 2]]  # sequence 0's positions reach its first block only


@pytest.mark.parametrize("module", [step_inputs_py, compiled], ids=["twin", "compiled"])
def test_tables_hold_the_blocks_the_positions_reach_whatever_the_lists_length(module):
    """Block lists are shared with the event loop, which appends as sequences grow (even while a
    step's inputs are built): the table's width and contents follow the positions, not len(list)."""
    if module is None:
        pytest.skip("Cython extension not built")
    short = module.build_step_inputs([[1], [2, 3]], [4, 0], [[5, 6], [7]], 4)
    long = module.build_step_inputs([[1], [2, 3]], [4, 0], [[5, 6, 9, 9, 9], [7, 9, 9]], 4)
    for a, b in zip(short, long):
        np.testing.assert_array_equal(a, b)
    assert long[5].tolist() == [[5, 6], [7, 0]]


@pytest.mark.skipif(compiled is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(20))
def test_compiled_equals_twin(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    args = random_step(rng, block_size)
    for ours, twin in zip(compiled.build_step_inputs(*args, block_size),
                          step_inputs_py.build_step_inputs(*args, block_size)):
        assert ours.dtype == twin.dtype
        np.testing.assert_array_equal(ours, twin)


@pytest.mark.parametrize("module", [step_inputs_py, compiled], ids=["twin", "compiled"])
def test_a_block_table_too_short_for_the_positions_is_an_error(module):
    if module is None:
        pytest.skip("Cython extension not built")
    with pytest.raises(ValueError, match="cannot hold"):
        module.build_step_inputs([[1, 2]], [3], [[7]], 4)
