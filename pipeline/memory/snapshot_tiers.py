"""The host tier of the recurrent-state snapshots (pipeline/memory/state_snapshots.py).

A hybrid model resumes a prefix only from a snapshot of its state, and a snapshot is large (every Gated DeltaNet
layer's state: 63 MB for the Qwen3.5-35B-A3B shape), so the device pool holds few (4 GiB: 65). A server with more
conversations than that would recompute each one from its start once its snapshot is evicted, even with every KV
block in the host tier. So an evicted snapshot is demoted to pinned host memory, and a prompt that resumes from a
host snapshot has it promoted back into the device pool before its state slot takes it; a preempted sequence's
state (saved into the device pool) goes the same way.

``TieredSnapshots`` is the device pool with the host tier behind it (a key in either tier counts as held) and queues
the copies, which ride in the next step plan (``BlockTransfers``): demotions (device snapshot -> host slot) run before
anything writes that snapshot in the plan, promotions (host slot -> device snapshot) before the state loads that read
it (pipeline/memory/block_transfers.py ``run_block_transfers``). A host slot is reused only when no queued copy and no
copy handed to the runner and not yet landed touches it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipeline.memory.block_transfers import BlockTransfers
from pipeline.memory.state_snapshots import SnapshotPool

if TYPE_CHECKING:
    from pipeline.config import EngineConfig

HOST_SHARE = 0.25  # of the host tier, what the snapshots of a hybrid model get unless configured


def snapshot_host_gib(config: EngineConfig, hybrid: bool) -> float:
    """The part of ``kv_offload_host_gib`` that holds snapshots: only a hybrid model with a host tier has one."""
    if not hybrid or not config.prefix_caching or config.kv_offload_host_gib <= 0:
        return 0.0
    share = config.state_snapshot_host_gib
    return config.kv_offload_host_gib * HOST_SHARE if share is None else share


def snapshot_pool(config: EngineConfig, count: int, nbytes: int, pin_memory: bool) -> SnapshotPool:
    """The engine's snapshot pool: ``count`` device snapshots of ``nbytes``, tiered when there is host room."""
    host_count = int(snapshot_host_gib(config, True) * (1 << 30)) // nbytes
    if host_count:
        return TieredSnapshots(count, config.state_snapshot_interval, host_count, nbytes, pin_memory)
    return SnapshotPool(count, config.state_snapshot_interval)


@dataclass(slots=True)
class HostSnapshotStats:
    held: int = 0
    capacity: int = 0
    demoted: int = 0  # device snapshots copied to host when the device pool evicted them
    kept: int = 0  # of the evicted ones, already on host (the same key: the same state), not copied again
    dropped: int = 0  # evicted but not demoted: every host slot was in use by a copy
    promoted: int = 0  # host snapshots copied back into the device pool
    evictions: int = 0  # host snapshots dropped for room
    bytes_to_host: int = 0
    bytes_to_device: int = 0


class TieredSnapshots(SnapshotPool):
    """A device ``SnapshotPool`` of ``capacity`` snapshots with a host tier of ``host_capacity`` snapshots of
    ``nbytes`` each behind it."""

    def __init__(self, capacity: int, interval: int, host_capacity: int, nbytes: int, pin_memory: bool = False) -> None:
        if host_capacity < 0 or nbytes <= 0:
            raise ValueError("a snapshot host tier needs host_capacity >= 0 and nbytes > 0")
        super().__init__(capacity, interval)
        pin = pin_memory and torch.cuda.is_available()
        self.buffer = torch.empty((host_capacity, nbytes), dtype=torch.uint8, pin_memory=pin)
        self.nbytes = nbytes
        self._host: OrderedDict[bytes, int] = OrderedDict()  # key -> host slot, least recently used first
        self._free_host = list(range(host_capacity - 1, -1, -1))
        self._demotions: list[tuple[int, int]] = []  # (device snapshot, host slot), for the next plan
        self._promotions: list[tuple[int, int]] = []  # (host slot, device snapshot)
        self._handed: list[tuple[BlockTransfers, set[int]]] = []  # plans' copies and the host slots they touch
        self.host_stats = HostSnapshotStats(capacity=host_capacity)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index or key in self._host

    def on_device(self, key: bytes) -> bool:
        return key in self._index

    def pin(self, key: bytes) -> int | None:
        """``SnapshotPool.pin``; a snapshot only on host is first promoted into a device snapshot (its copy queued).
        None when that cannot be done now (every device snapshot pinned or in a queued copy)."""
        if key not in self._index:
            slot = self._host.get(key)
            if slot is None:
                return None
            index = self.take_index(key)
            if index is None:
                return None
            self._host.move_to_end(key)
            self._promotions.append((slot, index))
            self.host_stats.promoted += 1
            self.host_stats.bytes_to_device += self.nbytes
        return super().pin(key)

    # --- the host tier ---------------------------------------------------------------------------------------
    def take_copies(self, transfers: BlockTransfers) -> bool:
        """Move the queued host copies into ``transfers`` (the plan being built); whether there were any."""
        if not self._demotions and not self._promotions:
            return False
        transfers.snapshot_host = self.buffer
        transfers.snapshot_saves, transfers.snapshot_loads = self._demotions, self._promotions
        touched = {slot for _, slot in self._demotions} | {slot for slot, _ in self._promotions}
        self._handed.append((transfers, touched))
        self._demotions, self._promotions = [], []
        return True

    def evicted(self, key: bytes, index: int) -> None:
        """The device pool evicts ``key``'s snapshot ``index``: copy it to host first (before the plan's copies
        write ``index`` again), unless host holds that key already."""
        if key in self._host:
            self._host.move_to_end(key)
            self.host_stats.kept += 1
            return
        slot = self._host_slot()
        if slot is None:
            self.host_stats.dropped += 1
            return
        self._host[key] = slot
        self._demotions.append((index, slot))
        self.host_stats.demoted += 1
        self.host_stats.bytes_to_host += self.nbytes

    def _host_slot(self) -> int | None:
        """A free host slot, else the least recently used one that no queued or unlanded copy touches."""
        if self._free_host:
            return self._free_host.pop()
        self._handed = [(t, slots) for t, slots in self._handed if not t.landed()]
        busy = {slot for _, slot in self._demotions} | {slot for slot, _ in self._promotions}
        for _, slots in self._handed:
            busy |= slots
        victim = next((k for k, slot in self._host.items() if slot not in busy), None)
        if victim is None:
            return None
        self.host_stats.evictions += 1
        return self._host.pop(victim)

    def host_entry(self) -> dict[str, Any] | None:
        self.host_stats.held = len(self._host)
        return asdict(self.host_stats)
