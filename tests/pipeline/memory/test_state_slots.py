"""The recurrent state slot pool (epochs, null slot, double free) and the cache manager's use of it: a slot is
taken with a sequence's first blocks, returned by every free, never shared with a forked sibling, and a chunk
carrying a stale epoch is refused when a step is planned."""

import pytest

from pipeline.memory.cache_manager import CacheManager
from pipeline.memory.kv_blocks import KVBlockPool
from pipeline.memory.state_slots import NULL_SLOT, StaleStateSlot, StateSlot, StateSlotPool
from pipeline.request import Request, SamplingParams
from pipeline.runner.step_plan import ScheduledChunk
from pipeline.sequence import Sequence


def test_slots_are_never_the_null_slot_and_run_out():
    pool = StateSlotPool(3)
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(s.index for s in slots) == [1, 2, 3] and NULL_SLOT not in [s.index for s in slots]
    assert pool.allocate() is None and pool.num_used == 3
    for s in slots:
        pool.free(s)
    assert pool.num_free == 3


def test_reuse_gets_a_new_epoch_and_stale_uses_are_refused():
    pool = StateSlotPool(1)
    first = pool.allocate()
    assert pool.check(first) == first.index
    pool.free(first)
    with pytest.raises(StaleStateSlot):
        pool.check(first)  # freed: a continuation planned before the free is refused
    second = pool.allocate()
    assert second.index == first.index and second.epoch != first.epoch
    with pytest.raises(StaleStateSlot):
        pool.check(first)  # reused by another sequence: the old owner's epoch is stale
    with pytest.raises(StaleStateSlot):
        pool.free(first)  # and cannot free the new owner's slot
    assert pool.check(second) == second.index
    pool.free(second)
    with pytest.raises(StaleStateSlot):
        pool.free(second)  # double free
    with pytest.raises(StaleStateSlot):
        pool.check(StateSlot(NULL_SLOT, 0))


def _seq(prompt_len: int = 10, n: int = 1) -> Sequence:
    request = Request("r", list(range(prompt_len)), SamplingParams(n=n), frozenset({2}), prompt_len + 16)
    return Sequence.from_request(request)


def test_cache_manager_takes_and_returns_slots_with_blocks():
    cache = CacheManager(KVBlockPool(16, 4), StateSlotPool(2))
    a, b, c = _seq(), _seq(), _seq()
    assert cache.allocate_slots(a, 10) and cache.allocate_slots(b, 10)
    assert a.state_slot is not None and b.state_slot is not None and a.state_slot.index != b.state_slot.index
    assert not cache.allocate_slots(c, 4)  # no slot left: nothing allocated
    assert c.state_slot is None and c.block_ids == [] and cache.num_used == 6
    slot = a.state_slot
    assert cache.allocate_slots(a, 4) and a.state_slot == slot  # more blocks, same slot
    cache.free(a)  # finish, cancel and preemption all end here
    assert a.state_slot is None and cache.num_state_slots_used == 1
    assert cache.allocate_slots(c, 4) and c.state_slot.index == slot.index and c.state_slot.epoch != slot.epoch
    stale = ScheduledChunk([1], 10, [1, 2, 3], [], state_slot=slot)
    with pytest.raises(StaleStateSlot):
        cache.state_slot_indices([stale])
    live = [ScheduledChunk([1], 0, [1], [], state_slot=s) for s in (b.state_slot, c.state_slot)]
    assert cache.state_slot_indices(live) == [b.state_slot.index, c.state_slot.index]
    cache.free(b)
    cache.free(c)
    assert cache.num_state_slots_used == 0 and cache.num_used == 0


def test_hybrid_siblings_share_no_prompt_blocks():
    """A forked sample cannot start its recurrent state mid-prompt: it recomputes the prompt in its own slot."""
    hybrid = CacheManager(KVBlockPool(16, 4), StateSlotPool(4))
    parent = _seq(prompt_len=12, n=2)
    assert hybrid.allocate_slots(parent, 12)
    parent.num_computed = 12
    assert hybrid.share_prompt(parent) == []
    dense = CacheManager(KVBlockPool(16, 4))
    other = _seq(prompt_len=12, n=2)
    assert dense.allocate_slots(other, 12)
    other.num_computed = 12
    assert len(dense.share_prompt(other)) == 3 and dense.state_slot_indices([]) is None
