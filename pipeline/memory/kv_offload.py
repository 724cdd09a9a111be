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

import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pipeline.memory.kv_tiers import DiskKVTier, HostKVTier

if TYPE_CHECKING:
    from pipeline.config import EngineConfig
    from pipeline.loading import LoadedModel

SETTLE_TIMEOUT_S = 60.0  # a runner that has not run a handed-over transfer by then is stuck: stop offloading


@dataclass(slots=True)
class BlockTransfers:
    """Copies a step runs before its forward, in order: device blocks to host slots, device blocks to device blocks,
    host slots to blocks, then (hybrid models) snapshots to their host slots, host slots to snapshots, state slots
    to state slots, state slots to snapshots and snapshots to state slots (pipeline/memory/state_snapshots.py,
    snapshot_tiers.py). Saves read first, so a block both evicted and written in one plan is
    saved before its new content arrives; block copies read before loads write (a copy's source may be a block
    evicted and refilled in the same plan)."""

    host: torch.Tensor | None  # the host tier's buffer [slots, block bytes] (uint8), if there is one
    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, target) device blocks: full-hit copies
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    state_saves: list[tuple[int, int]] = field(default_factory=list)  # (state slot, snapshot)
    state_loads: list[tuple[int, int]] = field(default_factory=list)  # (snapshot, state slot)
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (state slot, state slot): speculation
    # the snapshots' host tier (pipeline/memory/snapshot_tiers.py): its buffer [slots, snapshot bytes] (uint8),
    # demotions (snapshot, host slot) and promotions (host slot, snapshot), run before the state copies
    snapshot_host: torch.Tensor | None = None
    snapshot_saves: list[tuple[int, int]] = field(default_factory=list)
    snapshot_loads: list[tuple[int, int]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)  # the runner has queued every copy
    copied: torch.cuda.Event | None = None  # CUDA: when the queued copies have landed

    def landed(self) -> bool:
        return self.done.is_set() and (self.copied is None or self.copied.query())

    def wait(self, timeout: float) -> bool:
        """Until the host slots are free of these copies; False when the runner has not run them in time."""
        if not self.done.wait(timeout):
            return False
        if self.copied is not None:
            self.copied.synchronize()
        return True


def block_bytes(caches: Sequence[torch.Tensor]) -> int:
    """One block's bytes across the paged caches ([2, blocks, ...] each): a host slot's size."""
    return sum(2 * c[0, 0].numel() * c.element_size() for c in caches)


TRANSFER_CHUNK = 64  # blocks gathered (or scattered) through one device staging buffer at a time


@torch.inference_mode()
def run_block_transfers(transfers: BlockTransfers, caches: Sequence[torch.Tensor],
                        states: Sequence[torch.Tensor] = (), snapshots: Sequence[torch.Tensor] = (),
                        copy_stream: torch.cuda.Stream | None = None) -> None:
    """Runner side, on the step's stream. A block's bytes in a host slot are each paged cache's ``[2, block_size,
    ...]`` in cache order. Blocks move through device staging buffers of TRANSFER_CHUNK blocks; on CUDA each run of
    consecutive slots is one async copy to or from the pinned buffer (no pageable bounce), on ``copy_stream`` when
    given: the compute stream gathers a save's blocks and goes on, and waits for a load's bytes only before it
    scatters them.
    ``states`` and ``snapshots``: each recurrent cache ``[slots, ...]`` and its snapshots ``[snapshots, ...]``."""
    try:
        device = caches[0].device if caches else snapshots[0].device if snapshots else None
        side = copy_stream if device is not None and device.type == "cuda" else None
        for i in range(0, len(transfers.saves), TRANSFER_CHUNK):
            part = transfers.saves[i:i + TRANSFER_CHUNK]
            blocks = _indices([b for b, _ in part], device)
            data = torch.cat([c.index_select(1, blocks).transpose(0, 1).contiguous().view(len(part), -1)
                              .view(torch.uint8) for c in caches], dim=1)
            _on_side(side, lambda: _to_slots(transfers.host, [s for _, s in part], data), staged=data)
        if transfers.copies:
            src = _indices([a for a, _ in transfers.copies], device)
            dst = _indices([b for _, b in transfers.copies], device)
            for c in caches:  # as bytes: a block moves bit for bit whatever its dtype (CPU float8 has no index_copy_)
                raw = c.view(torch.uint8)
                raw.index_copy_(1, dst, raw.index_select(1, src))
        for i in range(0, len(transfers.loads), TRANSFER_CHUNK):
            part = transfers.loads[i:i + TRANSFER_CHUNK]
            blocks = _indices([b for _, b in part], device)
            data = _on_side(side, lambda: _from_slots(transfers.host, [s for s, _ in part], device))
            offset = 0
            for c in caches:
                size = 2 * c[0, 0].numel() * c.element_size()
                raw = c.view(torch.uint8)
                piece = data[:, offset:offset + size].contiguous()
                raw.index_copy_(1, blocks, piece.view(len(part), 2, *raw.shape[2:]).transpose(0, 1))
                offset += size
        _snapshot_host_copies(transfers, snapshots, side)
        _copy_states(transfers, states, snapshots)
        host_copies = transfers.saves or transfers.loads or transfers.snapshot_saves or transfers.snapshot_loads
        if device is not None and device.type == "cuda" and host_copies:
            transfers.copied = torch.cuda.Event()
            transfers.copied.record(side)  # the host slots' last use (None: the current stream)
    finally:
        transfers.done.set()


def _on_side(side: torch.cuda.Stream | None, copy: Callable[[], torch.Tensor | None],
             staged: torch.Tensor | None = None) -> torch.Tensor | None:
    """Run ``copy`` (host <-> device) on the side stream. A save (``staged``: its gathered blocks, on the compute
    stream) starts after what the compute stream has queued, and its buffer is not reused before the copy is done;
    a load waits for nothing there (it reads host slots no queued copy writes but earlier side-stream ones), and
    the compute stream waits for it before it reads the staging buffer the load returns."""
    if side is None:
        return copy()
    compute = torch.cuda.current_stream(side.device)
    if staged is not None:
        side.wait_stream(compute)
    with torch.cuda.stream(side):
        out = copy()
    if staged is not None:
        staged.record_stream(side)
    if out is not None:
        compute.wait_stream(side)
        out.record_stream(compute)
    return out


def _indices(values: list[int], device: torch.device | None) -> torch.Tensor:
    """int64 indices on ``device``; on CUDA through pinned memory without blocking: a pageable copy would hold the
    runner's thread until the device had drained everything queued before it."""
    tensor = torch.tensor(values, dtype=torch.int64)
    if device is not None and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor if device is None else tensor.to(device)


def _snapshot_host_copies(transfers: BlockTransfers, snapshots: Sequence[torch.Tensor],
                          side: torch.cuda.Stream | None) -> None:
    """Demotions (snapshots to host slots, gathered on the compute stream) then promotions (host slots to
    snapshots). A snapshot's bytes in a host slot are each recurrent cache's snapshot in cache order."""
    host = transfers.snapshot_host
    if transfers.snapshot_saves:
        pairs = transfers.snapshot_saves
        index = _indices([i for i, _ in pairs], snapshots[0].device)
        data = torch.cat([s.index_select(0, index).reshape(len(pairs), -1).view(torch.uint8) for s in snapshots], 1)
        _on_side(side, lambda: _to_slots(host, [slot for _, slot in pairs], data), staged=data)
    if transfers.snapshot_loads:
        pairs = transfers.snapshot_loads
        index = _indices([i for _, i in pairs], snapshots[0].device)
        data = _on_side(side, lambda: _from_slots(host, [slot for slot, _ in pairs], snapshots[0].device))
        offset = 0
        for s in snapshots:
            size = s[0].numel() * s.element_size()
            piece = data[:, offset:offset + size].contiguous().view(s.dtype).view(len(pairs), *s.shape[1:])
            s.index_copy_(0, index, piece)
            offset += size


def _copy_states(transfers: BlockTransfers, states: Sequence[torch.Tensor],
                 snapshots: Sequence[torch.Tensor]) -> None:
    """Device copies between state slots (a speculating sequence's state kept, or put back: pipeline/spec/), then
    between state slots and snapshots: saves first (a restore in the same plan may read one)."""
    if transfers.state_copies:
        src = _indices([a for a, _ in transfers.state_copies], states[0].device)
        dst = _indices([b for _, b in transfers.state_copies], states[0].device)
        for state in states:
            state.index_copy_(0, dst, state.index_select(0, src))
    for pairs, save in ((transfers.state_saves, True), (transfers.state_loads, False)):
        if not pairs:
            continue
        src = _indices([a for a, _ in pairs], states[0].device)
        dst = _indices([b for _, b in pairs], states[0].device)
        for state, snapshot in zip(states, snapshots):
            if save:
                snapshot.index_copy_(0, dst, state.index_select(0, src))
            else:
                state.index_copy_(0, dst, snapshot.index_select(0, src))


def _slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first row, first slot, count) for each run of consecutive slots: one copy each, not one per block."""
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, slot, 1))
    return runs


def _to_slots(host: torch.Tensor, slots: list[int], data: torch.Tensor) -> None:
    if data.device.type != "cuda":
        host[torch.tensor(slots)] = data.cpu()
        return
    for row, slot, count in _slot_runs(slots):
        host[slot:slot + count].copy_(data[row:row + count], non_blocking=True)


def _from_slots(host: torch.Tensor, slots: list[int], device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host[torch.tensor(slots)].to(device)
    data = torch.empty(len(slots), host.shape[1], dtype=host.dtype, device=device)
    for row, slot, count in _slot_runs(slots):
        data[row:row + count].copy_(host[slot:slot + count], non_blocking=True)
    return data


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


def kv_offload(config: EngineConfig, loaded: LoadedModel) -> KVOffload | None:
    """The configured tiers (None without a host tier or with prefix caching off). A hybrid model's snapshots take
    their part of the host memory (pipeline/memory/snapshot_tiers.py), the blocks the rest."""
    from pipeline.memory.snapshot_tiers import snapshot_host_gib  # that module builds on this one

    runner = loaded.runner
    if config.kv_offload_host_gib <= 0 or not config.prefix_caching:
        return None
    host_gib = config.kv_offload_host_gib - snapshot_host_gib(config, bool(runner.bytes_per_snapshot))
    size = block_bytes(runner.paged_caches)
    disk = (DiskKVTier(config.kv_offload_dir, int(config.kv_offload_disk_gib * (1 << 30)), (size,), torch.uint8)
            if config.kv_offload_dir is not None else None)
    host = HostKVTier(int(host_gib * (1 << 30)), (size,), torch.uint8,
                      pin_memory=torch.device(runner.device).type == "cuda", spill=disk)
    return KVOffload(host, disk)


def offload_stats(offload: KVOffload | None) -> dict[str, Any]:
    """The engine's stats entry: what moved each way and what each tier holds."""
    if offload is None:
        return {"enabled": False}
    tiers = {"host": asdict(offload.host.stats)}
    if offload.disk is not None:
        tiers["disk"] = asdict(offload.disk.stats)
    return {"enabled": True, **asdict(offload.stats), "tiers": tiers}
