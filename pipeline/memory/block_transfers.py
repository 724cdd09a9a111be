"""The device copies a step plan carries, and the runner side that runs them.

The cache manager and the KV tiers (pipeline/memory/kv_offload.py, snapshot_tiers.py) decide copies on the event
loop and queue them in a ``BlockTransfers``; it rides in the next step plan (pipeline/runner/step_plan.py) and the
runner runs it before that step's forward, on the device executor's one thread (``run_block_transfers``), so every
copy is ordered with the steps. Both sides import this module and it imports neither.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


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
