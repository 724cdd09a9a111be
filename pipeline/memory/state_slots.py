"""The recurrent state slot pool of hybrid models: one slot per running sequence, each use stamped with an epoch.

A slot indexes the per-layer state tensors (conv window and delta-rule state) that the model runner allocated
beside the paged KV pool. Slot 0 is the null slot: CUDA-graph padding rows point at it, so a write there never
touches a live sequence. A slot's contents need no clearing between owners: a chunk that starts at position 0
ignores them (the kernels' `has_initial_state`).

Epochs make reuse safe: every allocation hands out ``(index, epoch)`` with a fresh epoch, and every use is
checked against the slot's current epoch. A continuation planned for a sequence whose slot was freed and given
to another sequence carries the old epoch and is refused instead of advancing the new owner's state; a live
slot is never handed out twice, and a double free is an error.

Expert-parallel workers keep a ledger of the same slots (pipeline/dist/step_message.py): every step plan carries
the allocations and releases since the previous one (``take_changes``), sent to them before that step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

NULL_SLOT = 0


class StaleStateSlot(RuntimeError):
    """A use or free of a state slot with an epoch that is not the slot's current one."""


@dataclass(frozen=True, slots=True)
class StateSlot:
    index: int
    epoch: int


@dataclass(slots=True)
class SlotChanges:
    """The slots released and allocated between two step plans, net: a slot both allocated and released in
    between appears in neither (no step saw it). Releases go first (a released slot may be allocated again)."""

    released: list[StateSlot] = field(default_factory=list)
    allocated: list[StateSlot] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.released or self.allocated)


class StateSlotPool:
    def __init__(self, num_slots: int) -> None:
        """``num_slots`` usable slots (indices 1..num_slots; 0 is the null slot)."""
        if num_slots < 1:
            raise ValueError("a state slot pool needs at least one slot")
        self.capacity = num_slots
        self._free: deque[int] = deque(range(1, num_slots + 1))
        self._epoch = [0] * (num_slots + 1)
        self._live = [False] * (num_slots + 1)
        self._next_epoch = 1
        self._changes = SlotChanges()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self) -> StateSlot | None:
        """A free slot with a new epoch, or None when every slot is taken."""
        if not self._free:
            return None
        index = self._free.popleft()
        self._epoch[index] = self._next_epoch
        self._next_epoch += 1
        self._live[index] = True
        slot = StateSlot(index, self._epoch[index])
        self._changes.allocated.append(slot)
        return slot

    def check(self, slot: StateSlot) -> int:
        """The slot's index if it is live under this epoch; raises StaleStateSlot otherwise."""
        if not (0 < slot.index <= self.capacity and self._live[slot.index] and self._epoch[slot.index] == slot.epoch):
            current = self._epoch[slot.index] if 0 < slot.index <= self.capacity else "-"
            raise StaleStateSlot(f"state slot {slot.index} epoch {slot.epoch} is not live (current epoch {current})")
        return slot.index

    def free(self, slot: StateSlot) -> None:
        self.check(slot)
        self._live[slot.index] = False
        self._free.append(slot.index)
        if slot in self._changes.allocated:  # never in a plan: nobody needs to hear of it
            self._changes.allocated.remove(slot)
        else:
            self._changes.released.append(slot)

    def take_changes(self) -> SlotChanges:
        """The allocations and releases since the last call (for the step plan being built)."""
        changes, self._changes = self._changes, SlotChanges()
        return changes
