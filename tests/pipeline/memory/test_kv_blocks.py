import pytest

from pipeline.memory.kv_blocks import NULL_BLOCK, KVBlockPool, OutOfBlocks


def test_allocate_free_and_null_block_is_never_handed_out():
    pool = KVBlockPool(num_blocks=5, block_size=4)
    assert pool.capacity == 4 and pool.num_free == 4
    blocks = pool.allocate(4)
    assert NULL_BLOCK not in blocks and sorted(blocks) == [1, 2, 3, 4]
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.free(blocks)
    assert pool.num_used == 0


def test_shared_blocks_return_only_after_the_last_reference():
    pool = KVBlockPool(num_blocks=4, block_size=4)
    blocks = pool.allocate(2)
    pool.share(blocks)
    pool.free(blocks)
    assert pool.num_used == 2
    pool.free(blocks)
    assert pool.num_used == 0


def test_double_free_and_sharing_a_free_block_are_errors():
    pool = KVBlockPool(num_blocks=4, block_size=4)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError):
        pool.free(blocks)
    with pytest.raises(ValueError):
        pool.share(blocks)


def test_free_listeners_fire_on_every_release():
    pool = KVBlockPool(num_blocks=4, block_size=4)
    calls = []
    pool.add_free_listener(lambda: calls.append(1))
    blocks = pool.allocate(1)
    pool.share(blocks)
    pool.free(blocks)  # still referenced, but a sequence ended: waiters must re-check seats
    pool.free(blocks)
    assert len(calls) == 2


def test_blocks_needed_rounds_up():
    pool = KVBlockPool(num_blocks=4, block_size=16)
    assert [pool.blocks_needed(n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
