"""Recurrent-state snapshots of hybrid models: what lets a Gated DeltaNet model resume a cached prefix.

Attention layers resume any cached prefix from its KV blocks, but a GDN layer's state after n tokens exists only
while a sequence is at n. So the cache manager copies a sequence's states (every GDN layer's conv window and
delta-rule state) into a snapshot at block-aligned positions: where its prompt's last full block ends (the next
turn of a conversation starts with that prompt), and where a prompt chunk ends at least ``interval`` tokens after
its last snapshot. A snapshot is keyed by the prefix key of the block it ends (pipeline/memory/block_hashes.py),
so a prompt whose cached blocks reach it restores the state there, takes the blocks before it, and computes the
rest: the match never ends inside a block and no block needs a bigger size.

This pool is bookkeeping only: the snapshot tensors are the runner's (one per GDN cache, ``[snapshots, ...]``)
and the copies ride in the step plans (pipeline/memory/block_transfers.py ``BlockTransfers``). Least recently used
snapshots are evicted, never one that a waiting prompt pinned or a queued copy still reads or writes. With a host
tier (pipeline/memory/snapshot_tiers.py) an evicted snapshot is demoted there first (``evicted``).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True)
class SnapshotStats:
    taken: int = 0  # states copied into a snapshot
    restored: int = 0  # snapshots copied into a starting sequence's state slot
    evictions: int = 0


class SnapshotPool:
    def __init__(self, capacity: int, interval: int) -> None:
        if capacity < 0 or interval < 1:
            raise ValueError("a snapshot pool needs capacity >= 0 and interval >= 1")
        self.capacity = capacity
        self.interval = interval  # tokens between snapshots inside a long prompt
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> snapshot, least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self._reading: set[int] = set()  # snapshots a queued (not yet handed over) copy reads
        self._writing: set[int] = set()  # snapshots a queued copy fills (a save or a promotion from host)
        self._pins: dict[int, int] = {}  # snapshots prompts wait to restore (pin count)
        self.stats = SnapshotStats()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def num_pinned(self) -> int:
        """Snapshots waiting prompts hold (0 once every prompt started or ended)."""
        return len(self._pins)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def latest(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a prefix's block keys, in order) lead to the last one holding a snapshot (in any
        tier): the blocks a prompt takes when it restores that snapshot (0: none)."""
        for count in range(len(keys), 0, -1):
            if keys[count - 1] in self:
                return count
        return 0

    def pin(self, key: bytes) -> int:
        """The snapshot of ``key`` for a prompt that took the blocks before it and waits for its state slot: kept
        (most recently used, never evicted) until ``read`` or ``unpin``."""
        index = self._index[key]
        self._index.move_to_end(key)
        self._pins[index] = self._pins.get(index, 0) + 1
        return index

    def unpin(self, index: int) -> None:
        count = self._pins[index] - 1
        if count:
            self._pins[index] = count
        else:
            del self._pins[index]

    def read(self, index: int) -> int:
        """A pinned snapshot goes to a restore copy: kept until that copy is handed over (``handed``)."""
        self.unpin(index)
        self._reading.add(index)
        self.stats.restored += 1
        return index

    def reserve(self, key: bytes) -> int | None:
        """A snapshot to copy ``key``'s state into; None when there is nothing to copy (the key has one already:
        the same tokens give the same state) or no room (every snapshot is read by a queued copy, or capacity 0).
        The key may be read at once: a plan's saves run before its restores."""
        if key in self._index:
            self._index.move_to_end(key)
            return None
        index = self.take_index(key)
        if index is not None:
            self.stats.taken += 1
        return index

    def take_index(self, key: bytes) -> int | None:
        """A snapshot for ``key`` (absent) that a queued copy fills: a free one, else the least recently used one
        no queued copy touches and no prompt pinned (evicted: ``evicted`` first); None when there is none."""
        if self._free:
            index = self._free.pop()
        else:
            busy = self._reading | self._writing
            victim = next((k for k, i in self._index.items() if i not in busy and i not in self._pins), None)
            if victim is None:
                return None
            index = self._index.pop(victim)
            self.stats.evictions += 1
            self.evicted(victim, index)
        self._index[key] = index
        self._writing.add(index)
        return index

    def handed(self) -> None:
        """The queued copies went into a step plan: the runner runs them before any later plan's."""
        self._reading.clear()
        self._writing.clear()

    def host_entry(self) -> dict[str, Any] | None:
        """The host tier's stats entry (None: no host tier)."""
        return None

    def evicted(self, key: bytes, index: int) -> None:
        """``key``'s snapshot ``index`` is about to be reused (a host tier demotes it first)."""

    def take_copies(self, transfers: Any) -> bool:
        """Copies below the device for the plan being built (a host tier's); whether there were any."""
        return False


def snapshot_stats(pool: SnapshotPool | None) -> dict[str, Any]:
    """The engine's stats entry."""
    if pool is None:
        return {"enabled": False}
    entry = {"enabled": True, "capacity": pool.capacity, "held": len(pool), "pinned": pool.num_pinned,
             **asdict(pool.stats)}
    host = pool.host_entry()
    return entry if host is None else {**entry, "host": host}
