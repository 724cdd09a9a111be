"""The cache manager answers the stages' memory questions in tokens and sequences: slots for new and
lookahead tokens (all or nothing), freeing, prompt sharing between siblings, free notifications."""
import pytest

from pipeline.memory.cache_manager import CacheManager
from pipeline.memory.kv_blocks import KVBlockPool
from pipeline.request import Request, SamplingParams
from pipeline.sequence import Sequence

BLOCK = 4


def make_cache(num_blocks: int = 9) -> tuple[CacheManager, KVBlockPool]:
    pool = KVBlockPool(num_blocks=num_blocks, block_size=BLOCK)
    return CacheManager(pool), pool


def make_seq(prompt_len: int, n: int = 1, arrival: int = 1) -> Sequence:
    request = Request(f"r{arrival}", list(range(prompt_len)), SamplingParams(n=n, seed=1), frozenset({2}),
                      max_total_tokens=1000, arrival_seq=arrival)
    return Sequence.from_request(request)


def test_reports_the_pool_it_owns():
    cache, pool = make_cache(num_blocks=9)
    assert (cache.block_size, cache.capacity, cache.num_free, cache.num_used) == (BLOCK, 8, 8, 0)
    seq = make_seq(5)
    assert cache.allocate_slots(seq, seq.num_pending)
    assert (cache.num_free, cache.num_used) == (6, 2) == (pool.num_free, pool.num_used)


def test_slots_cover_computed_plus_new_tokens():
    cache, _ = make_cache()
    seq = make_seq(10)
    assert cache.blocks_needed(seq, 10) == 3
    assert cache.allocate_slots(seq, 10)
    assert len(seq.block_ids) == 3 and len(set(seq.block_ids)) == 3
    assert cache.blocks_needed(seq, 10) == 0 and cache.allocate_slots(seq, 10)  # covered: nothing added
    assert len(seq.block_ids) == 3
    seq.num_computed = 10
    seq.token_ids += [7, 8]  # 12 tokens: still 3 blocks
    assert cache.blocks_needed(seq, seq.num_pending) == 0
    seq.token_ids.append(9)  # 13 tokens: a 4th block
    assert cache.blocks_needed(seq, seq.num_pending) == 1
    assert cache.allocate_slots(seq, seq.num_pending) and len(seq.block_ids) == 4


def test_chunks_add_blocks_from_what_is_computed():
    cache, _ = make_cache()
    seq = make_seq(10)
    assert cache.allocate_slots(seq, 3)  # a first chunk of 3 tokens
    assert len(seq.block_ids) == 1
    seq.num_computed = 3
    assert cache.blocks_needed(seq, 6) == 2  # 9 tokens: 3 blocks
    assert cache.allocate_slots(seq, 6) and len(seq.block_ids) == 3


def test_lookahead_covers_the_token_still_on_the_device():
    cache, _ = make_cache()
    seq = make_seq(7)
    assert cache.allocate_slots(seq, 7)  # 2 blocks: 8 slots
    seq.num_computed = 7
    seq.token_ids.append(5)  # 8 tokens, the 8th pending; the step in flight samples a 9th
    assert cache.blocks_needed(seq, seq.num_pending) == 0
    assert cache.blocks_needed(seq, seq.num_pending, 1) == 1
    assert cache.allocate_slots(seq, seq.num_pending, 1) and len(seq.block_ids) == 3
    assert cache.blocks_needed(seq, seq.num_pending, 4) == 0  # 12 slots
    assert cache.blocks_needed(seq, seq.num_pending, 5) == 1


@pytest.mark.parametrize("held", [0, 1, 2, 3])
@pytest.mark.parametrize("length", [1, 4, 5, 8, 9, 12])
@pytest.mark.parametrize("ahead", [0, 1])
def test_pending_plus_lookahead_is_what_decode_grows_by(held, length, ahead):
    """Decode asks blocks_needed(seq, seq.num_pending, ahead): the blocks for len(token_ids) + ahead
    tokens, whatever part of them is computed."""
    cache, _ = make_cache()
    seq = make_seq(length)
    seq.block_ids = list(range(1, held + 1))
    for computed in range(0, length + 1):
        seq.num_computed = computed
        expected = max(0, -(-(length + ahead) // BLOCK) - held)
        assert cache.blocks_needed(seq, seq.num_pending, ahead) == expected


def test_allocation_is_all_or_nothing():
    cache, pool = make_cache(num_blocks=5)  # 4 usable blocks
    big = make_seq(17)
    assert cache.blocks_needed(big, 17) == 5
    assert not cache.allocate_slots(big, 17)
    assert big.block_ids == [] and cache.num_free == 4
    other = make_seq(8, arrival=2)
    assert cache.allocate_slots(other, 8)  # 2 left
    seq = make_seq(4, arrival=3)
    assert cache.allocate_slots(seq, 4)
    before = list(seq.block_ids)
    seq.num_computed = 4
    assert not cache.allocate_slots(seq, 4, 1)  # needs 2, has 1
    assert seq.block_ids == before and cache.num_free == 1
    assert cache.allocate_slots(seq, 4)  # exactly what is free
    assert cache.num_free == 0 and len(seq.block_ids) == 2
    assert pool.num_used == 4


def test_free_returns_everything_and_resets_the_sequence():
    cache, _ = make_cache()
    seq = make_seq(10)
    assert cache.allocate_slots(seq, 10)
    seq.num_computed = 10
    seq.token_ids.append(3)
    cache.free(seq)
    assert seq.block_ids == [] and seq.num_computed == 0
    assert cache.num_used == 0 and cache.num_free == cache.capacity
    assert len(seq.token_ids) == 11  # the tokens stay: it is recomputed from them
    cache.free(seq)  # nothing held: a no-op
    assert cache.num_used == 0


def test_siblings_share_full_prompt_blocks_until_both_are_freed():
    cache, pool = make_cache()
    parent = make_seq(10, n=2)
    assert cache.allocate_slots(parent, 10)
    parent.num_computed = 10
    shared = cache.share_prompt(parent)
    assert shared == parent.block_ids[:2]  # 8 of 10 prompt tokens are in full blocks; the tail is not shared
    assert [pool.refcount(b) for b in parent.block_ids] == [2, 2, 1]
    child = parent.fork(1, list(shared), cache.block_size)
    assert child.num_computed == 8 and child.num_pending == 2
    assert cache.allocate_slots(child, child.num_pending)  # its own tail block
    assert cache.num_used == 4
    cache.free(parent)
    assert cache.num_used == 3  # the parent's tail only
    assert [pool.refcount(b) for b in shared] == [1, 1]
    cache.free(child)
    assert cache.num_used == 0


def test_a_child_freed_first_leaves_the_parent_its_blocks():
    cache, _ = make_cache()
    parent = make_seq(8, n=2)
    assert cache.allocate_slots(parent, 8)
    parent.num_computed = 8
    child = parent.fork(1, cache.share_prompt(parent), cache.block_size)
    assert child.num_computed == 8 and cache.num_used == 2
    cache.free(child)
    assert cache.num_used == 2 and len(parent.block_ids) == 2
    cache.free(parent)
    assert cache.num_used == 0


def make_salted(tokens: list[int], arrival: int, salt: str | None = None) -> Sequence:
    request = Request(f"r{arrival}", tokens, SamplingParams(seed=1, cache_salt=salt), frozenset({2}),
                      max_total_tokens=1000, arrival_seq=arrival)
    return Sequence.from_request(request)


def compute(cache: CacheManager, seq: Sequence) -> None:
    """What prefill does: blocks for the rest of the prompt, then the computed tokens keyed."""
    assert cache.allocate_slots(seq, seq.num_pending)
    seq.num_computed = len(seq.token_ids)
    cache.register_computed(seq)


def test_a_prompt_takes_the_full_blocks_another_left_and_never_its_last_token():
    cache, pool = make_cache(num_blocks=17)
    first = make_salted(list(range(100, 114)), 1)  # 3 full blocks + 2 tokens
    assert cache.take_cached_prefix(first) == 0
    compute(cache, first)
    held = list(first.block_ids)
    cache.free(first)
    assert cache.num_used == 0 and cache.num_cached_free == 3  # the tail block had no key

    again = make_salted(list(range(100, 114)), 2)
    assert cache.take_cached_prefix(again) == 12 and again.block_ids == held[:3] and again.num_pending == 2
    assert cache.num_cached_free == 0 and cache.num_used == 3
    exact = make_salted(list(range(100, 112)), 3)  # the same 3 blocks, nothing after: a copy of the last one
    assert cache.take_cached_prefix(exact) == 11 and exact.block_ids[:2] == held[:2]
    assert exact.block_ids[2] not in held and pool.refcount(held[2]) == 1  # its own block; the cached one shared
    transfers = cache.take_transfers()
    assert transfers is not None and transfers.copies == [(held[2], exact.block_ids[2])]
    assert pool.refcount(held[0]) == 2
    mid = make_salted(list(range(100, 110)) + [7, 7, 7], 4)  # diverges inside block 3
    assert cache.take_cached_prefix(mid) == 8
    other = make_salted([1] + list(range(101, 114)), 5)  # diverges in block 1: nothing (the keys chain)
    assert cache.take_cached_prefix(other) == 0 and other.block_ids == []
    for seq in (again, exact, mid, other):  # each starts: counted once
        cache.count_prefix_query(seq)
    assert cache.prefix_hit_tokens == 12 + 11 + 8 and cache.prefix_queried_tokens == 14 + 12 + 13 + 14
    for seq in (again, exact, mid):
        cache.free(seq)
    assert cache.num_used == 0 and cache.num_free == cache.capacity


def test_salts_separate_tenants_and_caching_off_takes_nothing():
    cache, _ = make_cache(num_blocks=17)
    compute(cache, make_salted(list(range(9)), 1, salt="a"))
    assert cache.take_cached_prefix(make_salted(list(range(9)), 2, salt="b")) == 0
    assert cache.take_cached_prefix(make_salted(list(range(9)), 3)) == 0
    assert cache.take_cached_prefix(make_salted(list(range(9)), 4, salt="a")) == 8
    off = CacheManager(KVBlockPool(17, BLOCK), prefix_caching=False)
    compute(off, make_salted(list(range(9)), 1))
    assert off.take_cached_prefix(make_salted(list(range(9)), 2)) == 0 and off.num_cached_free == 0


def test_eviction_takes_the_least_recent_prefix_ends_first_and_never_a_held_block():
    cache, pool = make_cache(num_blocks=7)  # 6 usable
    a = make_salted(list(range(13)), 1)  # 3 full blocks + 1
    compute(cache, a)
    blocks_a = list(a.block_ids)
    cache.free(a)  # 3 cached, freed last-first: a's third block is the first to go
    b = make_salted([9] * 9, 2)
    assert cache.allocate_slots(b, 9)  # 3 blocks: the 3 keyless free ones first
    assert cache.num_cached_free == 3 and pool.evictions == 0
    c = make_salted([5] * 5, 3)
    assert cache.allocate_slots(c, 5)  # 2 blocks: evicts a's blocks 3 and 2, keeps its first
    assert pool.evictions == 2 and set(c.block_ids) == set(blocks_a[1:3])
    again = make_salted(list(range(13)), 4)
    assert cache.take_cached_prefix(again) == 4 and again.block_ids == blocks_a[:1]
    assert not cache.allocate_slots(make_salted([3] * 8, 5), 8)  # nothing free: held blocks are never taken
    assert pool.refcount(blocks_a[0]) == 1


def test_decode_blocks_are_keyed_as_they_fill_and_a_recompute_takes_them_back():
    cache, _ = make_cache(num_blocks=17)
    seq = make_salted(list(range(6)), 1)
    compute(cache, seq)
    for token in (50, 51, 52):  # decode: each step's token joins the sequence, its K/V the step after
        seq.token_ids.append(token)
        assert cache.allocate_slots(seq, 1)
        seq.num_computed += 1
        cache.register_computed(seq)
    assert seq.num_keyed == 2
    tokens = list(seq.token_ids)
    cache.free(seq)  # preempted: it recomputes, from its cached blocks
    assert seq.num_keyed == 0 and cache.take_cached_prefix(seq) == 8 and seq.token_ids == tokens


def test_free_listeners_fire_when_a_sequence_gives_blocks_back():
    cache, _ = make_cache()
    calls: list[int] = []
    cache.add_free_listener(lambda: calls.append(1))
    parent = make_seq(8, n=2)
    assert cache.allocate_slots(parent, 8)
    parent.num_computed = 8
    child = parent.fork(1, cache.share_prompt(parent), cache.block_size)
    assert calls == []  # allocating and sharing free nothing
    cache.free(child)  # still referenced by the parent, but a sequence ended: waiters re-check
    assert calls == [1]
    cache.free(parent)
    assert calls == [1, 1]
    cache.free(parent)  # held nothing: no wake-up
    assert calls == [1, 1]
