"""Prefix-cache blocks below the device: a keyed block the device pool evicts is copied to the host tier (and from
there demoted to disk, pipeline/memory/kv_tiers.py); a starting prompt whose prefix continues in a lower tier gets
fresh device blocks and the copies back.

The cache manager decides, the runner copies. Decisions queue ``BlockTransfers`` that ride in the next step plan;
the runner queues them before that step's forward, on the device executor's one thread, so they are ordered with
every step: an evicted block is gathered into a staging buffer before its new holder's first write (the same step or
a later one), and a restored block is filled before any step reads it. On CUDA the host side of each copy runs on a
copy stream of its own: an eviction's device-to-host copy leaves the staging buffer while the forward runs, and a
restore's host-to-device copy waits on nothing queued on the compute stream (only the forward that reads the block
waits for it). Restores write the pool's own blocks: every attention path reads them as it reads any block, there
is no second copy on the device.

A host slot is shared by the two threads, so it is reused (or demoted to disk) only when no copy touches it: never
while a queued transfer names it, and only after the transfers already handed to the runner are done (``done``).
A save still queued (not handed to the runner) and read by no queued load may be called off instead, its slot given
to a block evicted after it (``save``).
The disk tier is read and written on the planning thread only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipeline.memory.block_transfers import BlockTransfers, block_bytes
from pipeline.memory.kv_tiers import DiskKVTier, HostKVTier
from pipeline.memory.snapshot_tiers import snapshot_host_gib

if TYPE_CHECKING:
    from pipeline.config import EngineConfig

SETTLE_TIMEOUT_S = 60.0  # a runner that has not run a handed-over transfer by then is stuck: stop offloading


@dataclass(slots=True)
class OffloadStats:
    saved_blocks: int = 0  # device -> host
    restored_blocks: int = 0  # host -> device (disk hits pass through host)
    disk_restored_blocks: int = 0  # of those, read from disk first
    # evicted from the device but not saved: no host slot free of copies (a later eviction of the plan took its
    # slot, or it found none)
    dropped_blocks: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    swapped_out: int = 0  # preempted sequences whose computed blocks were copied to host
    swapped_in: int = 0  # preempted sequences that took every computed token back


class KVOffload:
    """The host and disk tiers as the cache manager sees them: ``save`` an evicted block, ``reach`` and
    ``restore`` a prompt's continuation, ``take_transfers`` for the next plan."""

    def __init__(self, host: HostKVTier, disk: DiskKVTier | None = None) -> None:
        if host.dtype != torch.uint8 or len(host.block_shape) != 1:
            raise ValueError("the host tier must hold blocks as flat uint8 bytes")
        self.host = host
        self.disk = disk
        self.stats = OffloadStats()
        self._queued = BlockTransfers(host.buffer)
        self._queued_slots: set[int] = set()
        self._saving: dict[int, tuple[int, bytes]] = {}  # host slot -> (index, key) of a queued save no load reads
        self._handed: list[BlockTransfers] = []

    def take_transfers(self) -> BlockTransfers | None:
        """The queued copies, for the plan being built (None when there are none)."""
        self._handed = [t for t in self._handed if not t.landed()]
        if not self._queued.saves and not self._queued.loads:
            return None
        transfers, self._queued = self._queued, BlockTransfers(self.host.buffer)
        self._queued_slots, self._saving = set(), {}
        self._handed.append(transfers)
        return transfers

    def save(self, block: int, key: bytes) -> None:
        """The device pool evicts keyed ``block``: copy it to the host tier (before its new holder writes it). When
        a plan evicts more blocks than the host has slots free of copies, the later blocks take the slots of the
        earlier ones' queued saves (``_replace_save``): the pool evicts a sequence's last blocks first, so the later
        ones are nearer the start of their prefix, without which the blocks after them are never reached."""
        if key in self.host:
            self.host.slot_index(key)  # the same content: only its use is new
            return
        slot = self._free_slot(key)
        if slot is None:
            self.stats.dropped_blocks += 1
            self._replace_save(block, key)
            return
        self._saving[slot] = (len(self._queued.saves), key)
        self._queued.saves.append((block, slot))
        self._queued_slots.add(slot)
        self.stats.saved_blocks += 1
        self.stats.bytes_to_host += self.host.block_nbytes

    def _replace_save(self, block: int, key: bytes) -> None:
        """Give the host's least recently used slot to ``block`` when it is a save queued in this plan that no load
        reads: that save is called off (its block dropped) before the runner sees it."""
        victim = self.host.victim_slot()
        if victim not in self._saving:
            return
        index, old_key = self._saving.pop(victim)
        self.host.cancel(old_key)
        slot = self.host.reserve_slot(key)  # the slot just freed
        self._queued.saves[index] = (block, slot)
        self._saving[slot] = (index, key)

    def reach(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the host tier, then the disk tier, holds (a disk entry may still fail its
        check in ``restore``)."""
        count = 0
        for key in keys:
            if key not in self.host and (self.disk is None or key not in self.disk):
                break
            count += 1
        return count

    def loading(self, block: int) -> bool:
        """Whether the copies queued for the next plan fill device ``block`` (it holds its content only after)."""
        return any(target == block for _, target in self._queued.loads)

    def restore(self, key: bytes, block: int) -> bool:
        """Queue ``key``'s copy into device ``block`` (through host when it is on disk). False when it cannot be
        had (gone, a corrupt file, no host slot free of copies): the caller computes it instead."""
        slot = self.host.slot_index(key, read=True)
        from_disk = slot is None
        if from_disk:
            # a slot first: a file is read (and counted a hit) only when its block can go on to the device
            if self.disk is None or key not in self.disk or not self._slot_available():
                return False
            data = self.disk.load(key)
            slot = self._free_slot(key) if data is not None else None
            if slot is None:
                return False
            self.host.buffer[slot].copy_(data)
        self._queued.loads.append((slot, block))
        self._queued_slots.add(slot)
        self._saving.pop(slot, None)  # a save this load reads is not called off
        self.stats.restored_blocks += 1
        self.stats.disk_restored_blocks += from_disk
        self.stats.bytes_to_device += self.host.block_nbytes
        return True

    def _slot_available(self) -> bool:
        """Whether ``_free_slot`` gives a slot: one is free, or the least recently used one is in no queued copy
        and no handed one still runs (this waits for them)."""
        if self.host.capacity_blocks == 0:
            return False
        victim = self.host.victim_slot()
        return victim is None or (victim not in self._queued_slots and self._settle())

    def _free_slot(self, key: bytes) -> int | None:
        """A host slot for ``key`` no copy uses; demoting its old key to disk (``HostKVTier.reserve_slot``)."""
        return self.host.reserve_slot(key) if self._slot_available() else None

    def _settle(self) -> bool:
        """Wait until the runner has run every transfer handed to it (their slots are then free to reuse)."""
        for transfers in self._handed:
            if not transfers.wait(SETTLE_TIMEOUT_S):
                return False
        self._handed.clear()
        return True

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def kv_offload(config: EngineConfig, caches: Sequence[torch.Tensor], hybrid: bool,
               pin_memory: bool) -> KVOffload | None:
    """The configured tiers for the paged ``caches`` (None without a host tier or with prefix caching off). A hybrid
    model's snapshots take their part of the host memory (pipeline/memory/snapshot_tiers.py), the blocks the rest."""
    if config.kv_offload_host_gib <= 0 or not config.prefix_caching:
        return None
    host_gib = config.kv_offload_host_gib - snapshot_host_gib(config, hybrid)
    size = block_bytes(caches)
    disk = (DiskKVTier(config.kv_offload_dir, int(config.kv_offload_disk_gib * (1 << 30)), (size,), torch.uint8)
            if config.kv_offload_dir is not None else None)
    host = HostKVTier(int(host_gib * (1 << 30)), (size,), torch.uint8, pin_memory=pin_memory, spill=disk)
    return KVOffload(host, disk)


def offload_stats(offload: KVOffload | None) -> dict[str, Any]:
    """The engine's stats entry: what moved each way and what each tier holds."""
    if offload is None:
        return {"enabled": False}
    tiers = {"host": asdict(offload.host.stats)}
    if offload.disk is not None:
        tiers["disk"] = asdict(offload.disk.stats)
    return {"enabled": True, **asdict(offload.stats), "tiers": tiers}
