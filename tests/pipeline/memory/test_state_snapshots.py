"""SnapshotPool (pipeline/memory/state_snapshots.py): keys to snapshots, least recently used evicted first, never
one a waiting prompt pinned or a queued copy reads or fills."""
from __future__ import annotations

import pytest

from pipeline.memory.state_snapshots import SnapshotPool, snapshot_stats


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def test_latest_finds_the_last_key_holding_a_snapshot():
    pool = SnapshotPool(4, 16)
    pool.reserve(key(1))
    pool.reserve(key(3))
    assert pool.latest([key(0), key(1), key(2), key(3), key(4)]) == 4
    assert pool.latest([key(0), key(1), key(2)]) == 2
    assert pool.latest([key(0)]) == 0


def test_a_key_already_held_is_not_copied_again():
    pool = SnapshotPool(2, 16)
    assert pool.reserve(key(1)) is not None
    assert pool.reserve(key(1)) is None and pool.stats.taken == 1


def test_eviction_skips_pinned_and_read_snapshots():
    pool = SnapshotPool(2, 16)
    a, b = pool.reserve(key(1)), pool.reserve(key(2))
    pool.handed()  # their saves went into a plan
    pinned = pool.pin(key(1))
    assert pinned == a
    assert pool.reserve(key(3)) == b and key(2) not in pool  # key 1 is pinned: key 2 goes
    pool.handed()
    pool.read(pinned)  # the prompt got its state slot: a restore copy is queued
    assert pool.reserve(key(4)) == b  # key 1 is read by the queued copy: key 3 goes
    pool.handed()
    pool.pin(key(4))
    pool.read(pool.pin(key(1)))
    assert pool.reserve(key(5)) is None  # one read, one pinned: nothing to evict
    pool.handed()
    assert pool.reserve(key(5)) == a and key(1) not in pool
    assert pool.stats.evictions == 3 and pool.stats.restored == 2


def test_a_snapshot_filled_by_the_plan_being_built_is_not_evicted_in_it():
    """Two saves queued for one plan into a pool of one: the second gets nothing (both copies would write the
    one snapshot); after the plan is handed, the next one may evict it. Evictions are reported first."""
    pool = SnapshotPool(1, 16)
    evicted: list[tuple[bytes, int]] = []
    pool.evicted = lambda k, i: evicted.append((k, i))
    assert pool.reserve(key(1)) == 0
    assert pool.reserve(key(2)) is None and key(1) in pool
    pool.handed()
    assert pool.reserve(key(2)) == 0 and evicted == [(key(1), 0)]


def test_unpin_releases_and_counts():
    pool = SnapshotPool(1, 16)
    pool.reserve(key(1))
    pool.handed()
    first, second = pool.pin(key(1)), pool.pin(key(1))
    pool.unpin(first)
    assert pool.reserve(key(2)) is None  # still pinned once
    pool.unpin(second)
    assert pool.reserve(key(2)) is not None
    assert snapshot_stats(pool) == {"enabled": True, "capacity": 1, "held": 1, "pinned": 0, "taken": 2,
                                    "restored": 0, "evictions": 1}
    assert snapshot_stats(None) == {"enabled": False}


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        SnapshotPool(-1, 16)
    with pytest.raises(ValueError):
        SnapshotPool(4, 0)
