"""KVOffload (pipeline/memory/kv_offload.py): the copies the runner runs (block_transfers.py), the host slots a copy
still uses, the disk tier behind the host tier, and the cache manager's prefix runs continuing into the tiers."""
from __future__ import annotations

import os

import pytest
import torch

import pipeline.memory.block_transfers as block_transfers
import pipeline.memory.kv_offload as kv_offload
from pipeline.memory.block_hashes import extend_block_hashes
from pipeline.memory.kv_blocks import KVBlockPool
from pipeline.memory.block_transfers import block_bytes, run_block_transfers
from pipeline.memory.kv_offload import KVOffload
from pipeline.memory.kv_tiers import DiskKVTier, HostKVTier


def caches(num_blocks: int = 8) -> list[torch.Tensor]:
    """Two paged caches of different shapes and dtypes, every element distinct."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, num_blocks, 4, 2, 8, generator=gen),
            torch.randn(2, num_blocks, 4, 1, 16, generator=gen).to(torch.bfloat16)]


def offload(kv: list[torch.Tensor], host_blocks: int, disk: DiskKVTier | None = None) -> KVOffload:
    size = block_bytes(kv)
    return KVOffload(HostKVTier(host_blocks * size, (size,), torch.uint8, spill=disk), disk)


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


@pytest.mark.parametrize("chunk", [1, 64])
def test_blocks_round_trip_through_host_slots_bit_exact(chunk, monkeypatch):
    monkeypatch.setattr(block_transfers, "TRANSFER_CHUNK", chunk)
    kv = caches()
    before = [c.clone() for c in kv]
    tiers = offload(kv, 4)
    for block in (3, 5):
        tiers.save(block, key(block))
    run_block_transfers(tiers.take_transfers(), kv)
    for c in kv:
        c[:, 3:6] = 0
    assert tiers.restore(key(3), 6) and tiers.restore(key(5), 7)
    transfers = tiers.take_transfers()
    run_block_transfers(transfers, kv)
    assert transfers.done.is_set()
    for c, b in zip(kv, before):
        assert torch.equal(c[:, 6], b[:, 3]) and torch.equal(c[:, 7], b[:, 5])
    assert tiers.stats.saved_blocks == 2 and tiers.stats.restored_blocks == 2
    assert tiers.stats.bytes_to_device == 2 * block_bytes(kv)


def test_saves_run_before_loads_in_one_plan():
    """An evicted block reused as a restore target in the same step: its old content is saved first."""
    kv = caches()
    before = [c.clone() for c in kv]
    tiers = offload(kv, 4)
    tiers.save(2, key(2))
    tiers.save(4, key(4))
    run_block_transfers(tiers.take_transfers(), kv)
    tiers.save(6, key(6))  # evicted now; block 6 then takes key 2's content back
    assert tiers.restore(key(2), 6)
    run_block_transfers(tiers.take_transfers(), kv)
    assert tiers.restore(key(6), 1)
    run_block_transfers(tiers.take_transfers(), kv)
    for c, b in zip(kv, before):
        assert torch.equal(c[:, 6], b[:, 2]) and torch.equal(c[:, 1], b[:, 6])


def test_block_copies_read_after_saves_and_before_loads():
    """A full hit's copy source evicted (saved) and refilled from host in the same plan: the copy gets the old
    content, the host slot too, and the refill lands after both."""
    kv = caches()
    before = [c.clone() for c in kv]
    tiers = offload(kv, 4)
    tiers.save(5, key(5))
    run_block_transfers(tiers.take_transfers(), kv)
    tiers.save(2, key(2))  # block 2 evicted ...
    assert tiers.restore(key(5), 2)  # ... and given block 5's saved content
    transfers = tiers.take_transfers()
    transfers.copies.append((2, 7))  # queued before the eviction: block 2 as it was
    run_block_transfers(transfers, kv)
    assert tiers.restore(key(2), 1)
    run_block_transfers(tiers.take_transfers(), kv)
    for c, b in zip(kv, before):
        assert torch.equal(c[:, 7], b[:, 2]) and torch.equal(c[:, 2], b[:, 5]) and torch.equal(c[:, 1], b[:, 2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream is CUDA's")
def test_copies_on_a_copy_stream_keep_step_order():
    """Saves leave a staging buffer gathered before the forward writes; loads land before the forward reads."""
    kv = [c.cuda() for c in caches()]
    before = [c.clone() for c in kv]
    size = block_bytes(kv)
    tiers = KVOffload(HostKVTier(4 * size, (size,), torch.uint8, pin_memory=True))
    side = torch.cuda.Stream()
    for block in (3, 5):
        tiers.save(block, key(block))
    run_block_transfers(tiers.take_transfers(), kv, copy_stream=side)
    for c in kv:  # the next forward overwrites the evicted blocks at once
        c[:, 3:6] = 0
    assert tiers.restore(key(3), 6) and tiers.restore(key(5), 7)
    transfers = tiers.take_transfers()
    run_block_transfers(transfers, kv, copy_stream=side)
    read = [c[:, 6:8].clone() for c in kv]  # read on the compute stream right after
    assert transfers.wait(10.0)
    for c, b, early in zip(kv, before, read):
        assert torch.equal(c[:, 6], b[:, 3]) and torch.equal(c[:, 7], b[:, 5])
        assert torch.equal(early, b[:, [3, 5]])


def test_a_plan_evicting_more_than_the_host_holds_keeps_its_later_blocks():
    """Both slots wait for this plan's copies: a third eviction takes the slot of the oldest queued save (that block
    is dropped, no slot gets two copies), since the pool evicts a prefix's last blocks first; a slot a queued load
    reads is never taken."""
    kv = caches()
    before = [c.clone() for c in kv]
    tiers = offload(kv, 2)
    for block in (1, 2, 3):
        tiers.save(block, key(block))
    assert tiers.stats.dropped_blocks == 1 and tiers.stats.saved_blocks == 2
    assert key(1) not in tiers.host and key(2) in tiers.host and key(3) in tiers.host
    assert tiers.host.stats.bytes_in == 2 * block_bytes(kv)
    transfers = tiers.take_transfers()
    assert transfers.saves == [(3, 0), (2, 1)]
    run_block_transfers(transfers, kv)
    assert tiers.restore(key(3), 6)  # reads slot 0 in the next plan
    tiers.save(4, key(4))  # demotes key(2), whose copy has run
    tiers.save(5, key(5))  # the only other slot is the load's: dropped
    assert key(3) in tiers.host and key(4) in tiers.host and key(5) not in tiers.host
    assert tiers.stats.dropped_blocks == 2
    transfers = tiers.take_transfers()
    assert transfers.saves == [(4, 1)] and transfers.loads == [(0, 6)]
    run_block_transfers(transfers, kv)
    assert all(torch.equal(c[:, 6], b[:, 3]) for c, b in zip(kv, before))


def test_a_handed_copy_not_yet_run_blocks_reuse(monkeypatch):
    """A plan handed to the runner but not run: its slots are not reused (here the wait gives up at once)."""
    monkeypatch.setattr(kv_offload, "SETTLE_TIMEOUT_S", 0.0)
    kv = caches()
    tiers = offload(kv, 1)
    tiers.save(1, key(1))
    handed = tiers.take_transfers()
    tiers.save(2, key(2))
    assert tiers.stats.dropped_blocks == 1 and key(1) in tiers.host
    run_block_transfers(handed, kv)
    tiers.save(2, key(2))  # now the slot is free of copies
    assert key(2) in tiers.host and key(1) not in tiers.host


def test_disk_behind_host_and_a_corrupt_file_is_refused(tmp_path):
    kv = caches()
    before = [c.clone() for c in kv]
    disk = DiskKVTier(tmp_path, 1 << 20, (block_bytes(kv),), torch.uint8)
    tiers = offload(kv, 1, disk)
    for block in (1, 2, 3):
        tiers.save(block, key(block))
        run_block_transfers(tiers.take_transfers(), kv)
    assert key(1) in disk and key(2) in disk and key(3) in tiers.host
    assert tiers.reach([key(1), key(2), key(3), key(4)]) == 3
    assert tiers.restore(key(1), 7)
    run_block_transfers(tiers.take_transfers(), kv)
    assert all(torch.equal(c[:, 7], b[:, 1]) for c, b in zip(kv, before))
    assert tiers.stats.disk_restored_blocks == 1
    path = os.path.join(disk.path, key(2).hex() + next(n for n in os.listdir(disk.path))[16:])
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x10
    open(path, "wb").write(bytes(data))
    assert not tiers.restore(key(2), 6)
    assert disk.stats.corrupt == 1 and tiers.take_transfers() is None
    tiers.close()


def test_cache_manager_prefix_runs_continue_into_the_host_tier():
    from types import SimpleNamespace

    from pipeline.memory.cache_manager import CacheManager

    kv = caches(12)
    tiers = offload(kv, 8)
    pool = KVBlockPool(12, 4)
    cache = CacheManager(pool, None, True, tiers)
    tokens = list(range(100, 121))  # 5 full blocks and one more token
    request = SimpleNamespace(params=SimpleNamespace(cache_salt=None))

    def sequence() -> SimpleNamespace:
        return SimpleNamespace(token_ids=tokens, block_ids=[], block_keys=[], num_computed=0, num_keyed=0,
                               missed_at=-1, request=request, state_slot=None, spare_slots=[],
                               snapshot_pos=0, restore_from=None, preemptions=0)

    first = sequence()
    assert cache.allocate_slots(first, len(tokens))
    first.num_computed = len(tokens)
    cache.register_computed(first)
    cache.free(first)
    keys = extend_block_hashes([], tokens, 4, 5, None)
    other = sequence()
    other.token_ids = list(range(500, 544))  # 11 blocks: evicts the five cached ones
    assert cache.allocate_slots(other, len(other.token_ids))
    assert tiers.stats.saved_blocks == 5 and all(k in tiers.host for k in keys)
    run_block_transfers(cache.take_transfers(), kv)
    cache.free(other)
    again = sequence()
    assert cache.take_cached_prefix(again) == 20  # the blocks before the last token, all from host
    assert len(again.block_ids) == 5 and tiers.stats.restored_blocks == 5
    loads = cache.take_transfers().loads
    assert [b for _, b in loads] == again.block_ids
    assert pool.lookup(keys) == again.block_ids  # keyed on the device again
    cache.free(again)
    assert pool.num_used == 0


def test_a_whole_prompt_hit_copies_its_last_block_from_any_tier():
    """A block-aligned prompt cached whole computes only its last token: its last block is copied on the device, or
    restored from host unkeyed; a last block still being restored in the same plan is computed instead."""
    from types import SimpleNamespace

    from pipeline.memory.cache_manager import CacheManager

    kv = caches(12)
    tiers = offload(kv, 8)
    pool = KVBlockPool(12, 4)
    cache = CacheManager(pool, None, True, tiers)
    request = SimpleNamespace(params=SimpleNamespace(cache_salt=None))

    def sequence(tokens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(token_ids=tokens, block_ids=[], block_keys=[], num_computed=0, num_keyed=0,
                               missed_at=-1, request=request, state_slot=None, spare_slots=[],
                               snapshot_pos=0, restore_from=None, preemptions=0)

    tokens = list(range(100, 120))  # 5 full blocks
    first = sequence(tokens)
    assert cache.allocate_slots(first, 20)
    first.num_computed = 20
    cache.register_computed(first)
    held = list(first.block_ids)
    cache.free(first)
    on_device = sequence(tokens)
    assert cache.take_cached_prefix(on_device) == 19 and on_device.block_ids[:4] == held[:4]
    assert cache.take_transfers().copies == [(held[4], on_device.block_ids[4])]
    cache.free(on_device)
    other = sequence(list(range(500, 544)))  # 11 blocks: every cached one goes to host
    assert cache.allocate_slots(other, 44)
    run_block_transfers(cache.take_transfers(), kv)
    cache.free(other)
    keys = extend_block_hashes([], tokens, 4, 5, None)
    restoring = sequence(tokens + [1])  # restores all five, keyed, in this plan
    assert cache.take_cached_prefix(restoring) == 20
    same_plan = sequence(tokens)  # its last block is one of those loads: computed, not copied
    assert cache.take_cached_prefix(same_plan) == 16
    transfers = cache.take_transfers()
    assert len(transfers.loads) == 5 and not transfers.copies
    run_block_transfers(transfers, kv)
    for seq in (restoring, same_plan):
        cache.free(seq)
    other = sequence(list(range(500, 544)))
    assert cache.allocate_slots(other, 44)  # the five are on host already: nothing to save
    assert cache.take_transfers() is None and pool.lookup(keys) == []
    cache.free(other)
    from_host = sequence(tokens)
    assert cache.take_cached_prefix(from_host) == 19
    assert pool.lookup(keys) == from_host.block_ids[:4]  # the last block's copy is the sequence's own, unkeyed
    assert len(cache.take_transfers().loads) == 5
    cache.free(from_host)
    assert pool.num_used == 0


def test_evictions_and_swaps_past_the_host_keep_a_prefixs_first_blocks():
    """A host of three slots: five cached blocks leaving the device in one plan (the pool evicts the last first) or a
    preempted sequence's five blocks swapped out, it keeps their first three, which a return of the prompt reaches
    (a tail kept without its first blocks would be reached by no lookup)."""
    from types import SimpleNamespace

    from pipeline.memory.cache_manager import CacheManager

    kv = caches(12)
    before = [c.clone() for c in kv]
    tiers = offload(kv, 3)
    pool = KVBlockPool(12, 4)
    cache = CacheManager(pool, None, True, tiers)
    request = SimpleNamespace(params=SimpleNamespace(cache_salt=None))

    def sequence(tokens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(token_ids=tokens, block_ids=[], block_keys=[], num_computed=0, num_keyed=0,
                               missed_at=-1, request=request, state_slot=None, spare_slots=[],
                               snapshot_pos=0, restore_from=None, preemptions=0)

    def computed(tokens: list[int]) -> SimpleNamespace:
        seq = sequence(tokens)
        assert cache.allocate_slots(seq, len(tokens))
        seq.num_computed = len(tokens)
        cache.register_computed(seq)
        return seq

    tokens = list(range(100, 121))  # 5 full blocks and one more token
    keys = extend_block_hashes([], tokens, 4, 5, None)
    first = computed(tokens)
    held = list(first.block_ids)
    cache.free(first)
    other = sequence(list(range(500, 544)))  # 11 blocks: evicts the five cached ones in one plan
    assert cache.allocate_slots(other, len(other.token_ids))
    assert [k in tiers.host for k in keys] == [True, True, True, False, False]
    assert tiers.stats.saved_blocks == 3 and tiers.stats.dropped_blocks == 2
    transfers = cache.take_transfers()
    assert sorted(block for block, _ in transfers.saves) == sorted(held[:3])
    run_block_transfers(transfers, kv)
    cache.free(other)
    again = sequence(tokens)
    assert cache.take_cached_prefix(again) == 12
    run_block_transfers(cache.take_transfers(), kv)
    for c, b in zip(kv, before):
        assert torch.equal(c[:, again.block_ids], b[:, held[:3]])
    cache.free(again)

    swapped = computed(list(range(200, 221)))
    swapped_keys = list(swapped.block_keys)
    cache.preempt(swapped)  # its partial block and five full ones, with room for three
    assert [k in tiers.host for k in swapped_keys] == [True, True, True, False, False]
    assert pool.num_used == 0


@pytest.mark.parametrize("bad", [dict(dtype=torch.float32), dict(shape=(4, 2))])
def test_the_host_tier_must_hold_flat_bytes(bad):
    tier = HostKVTier(1024, bad.get("shape", (8,)), bad.get("dtype", torch.uint8))
    with pytest.raises(ValueError):
        KVOffload(tier)


def test_slot_runs_cover_each_slot_once_in_order():
    runs = block_transfers._slot_runs([4, 5, 6, 9, 2, 3, 10])
    assert runs == [(0, 4, 3), (3, 9, 1), (4, 2, 2), (6, 10, 1)]
    assert block_transfers._slot_runs([]) == []
