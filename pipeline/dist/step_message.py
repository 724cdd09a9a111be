"""What the head sends the expert-parallel workers, one message at a time, and what a worker checks before acting.

Every rank runs the same forwards over its share of the experts, so a worker needs each step's forward batch, the
device copies that go before it (blocks, recurrent state slots), and the state slots' lives: a slot is allocated
and released by explicit messages carrying the head's epoch for it (pipeline/memory/state_slots.py), and every row
of a step names its slot's epoch. A worker refuses a message of another layout version, one out of sequence, and
a step or copy that names a slot under an epoch it does not hold, instead of misreading it or advancing another
sequence's state. Nothing in a message is a sentinel a real value could equal: slot 0 is the null slot, which is
never allocated, and -1 (no keep slot) is no slot index.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from pipeline.memory.state_slots import NULL_SLOT, StaleStateSlot
from pipeline.runner.step_plan import ForwardBatch

STEP_MESSAGE_VERSION = 2


class StepMessageVersionError(ValueError):
    """A message of another layout version (ranks running different code)."""


class OutOfSequence(RuntimeError):
    """A message whose number is not the next one (lost, repeated or reordered)."""


class MessageKind(IntEnum):
    STEP = 1  # copies, then a forward
    ALLOCATE = 2  # state slots given to sequences, under new epochs
    RELEASE = 3  # state slots given back
    STOP = 4  # the head is shutting down


def _none() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


def _pairs() -> np.ndarray:
    return np.zeros((0, 2), dtype=np.int64)


# the integer arrays of a message, in wire order, and their widths (1: a list, 2: pairs)
_FIELDS = (("slots", 1), ("epochs", 1), ("block_copies", 2), ("loaded_blocks", 1), ("loaded_snapshots", 1),
           ("state_copies", 2), ("state_saves", 2), ("state_loads", 2))


@dataclass(frozen=True, slots=True)
class StepMessage:
    """A STEP runs, in order: ``block_copies`` (device blocks), the bytes of ``loaded_blocks`` and
    ``loaded_snapshots`` (what the head's KV tiers restored; they arrive by broadcast from the head's device, the
    workers keep no tiers), ``state_copies``, ``state_saves`` (state slot to snapshot) and ``state_loads``
    (snapshot to state slot), then the forward, whose fed tokens (``fed_tokens`` of them, the previous step's
    sampled ids, on the head's device) arrive by broadcast just before it."""

    kind: MessageKind
    number: int  # messages count from 0 without gaps
    slots: np.ndarray = field(default_factory=_none)  # ALLOCATE / RELEASE
    epochs: np.ndarray = field(default_factory=_none)  # per slot; STEP: per row (0: the null slot)
    block_copies: np.ndarray = field(default_factory=_pairs)  # [n, 2]: (source, destination) device blocks
    loaded_blocks: np.ndarray = field(default_factory=_none)
    loaded_snapshots: np.ndarray = field(default_factory=_none)
    state_copies: np.ndarray = field(default_factory=_pairs)  # [n, 2]: (source, destination) state slots
    state_saves: np.ndarray = field(default_factory=_pairs)  # [n, 2]: (state slot, snapshot)
    state_loads: np.ndarray = field(default_factory=_pairs)  # [n, 2]: (snapshot, state slot)
    fed_tokens: int = 0
    forward: ForwardBatch | None = None  # STEP

    def to_bytes(self) -> bytes:
        forward = b"" if self.forward is None else self.forward.to_bytes()
        arrays = [np.ascontiguousarray(getattr(self, name), dtype=np.int64) for name, _ in _FIELDS]
        header = np.array([STEP_MESSAGE_VERSION, int(self.kind), self.number, self.fed_tokens,
                           *(len(a) for a in arrays), len(forward)], dtype=np.int64)
        return b"".join([header.tobytes(), *(a.tobytes() for a in arrays), forward])

    @classmethod
    def from_bytes(cls, data: bytes) -> StepMessage:
        version = int(np.frombuffer(data, dtype=np.int64, count=1)[0]) if len(data) >= 8 else -1
        if version != STEP_MESSAGE_VERSION:
            raise StepMessageVersionError(f"step message version {version}, this rank reads {STEP_MESSAGE_VERSION}")
        header = np.frombuffer(data, dtype=np.int64, count=5 + len(_FIELDS))
        kind, number, fed = (int(x) for x in header[1:4])
        offset = header.nbytes
        arrays: dict[str, np.ndarray] = {}
        for (name, width), count in zip(_FIELDS, header[4:4 + len(_FIELDS)].tolist()):
            values = np.frombuffer(data, dtype=np.int64, count=count * width, offset=offset)
            arrays[name] = values.reshape((count, 2) if width == 2 else (count,)).copy()
            offset += values.nbytes
        n_forward = int(header[-1])
        if offset + n_forward != len(data):
            raise ValueError(f"step message of {len(data)} bytes, its header describes {offset + n_forward}")
        forward = ForwardBatch.from_bytes(data[offset:]) if n_forward else None
        return cls(MessageKind(kind), number, **arrays, fed_tokens=fed, forward=forward)


class SlotLedger:
    """A worker's record of the head's state slots: which are live and under which epoch, and the next message
    number. ``accept`` checks a message against it (and records allocations and releases) before the worker acts
    on it."""

    def __init__(self, num_slots: int) -> None:
        self._epoch = [0] * (num_slots + 1)
        self._live = [False] * (num_slots + 1)
        self.next_number = 0

    def accept(self, message: StepMessage) -> None:
        if message.number != self.next_number:
            raise OutOfSequence(f"message {message.number}, expected {self.next_number}")
        if message.kind in (MessageKind.ALLOCATE, MessageKind.RELEASE):
            if len(message.slots) != len(message.epochs):
                raise ValueError(f"{len(message.slots)} slots with {len(message.epochs)} epochs")
            for slot, epoch in zip(message.slots.tolist(), message.epochs.tolist()):
                self._check_index(slot)
                if message.kind is MessageKind.ALLOCATE and (self._live[slot] or epoch <= self._epoch[slot]):
                    raise StaleStateSlot(f"state slot {slot} allocated again under epoch {epoch} (it holds "
                                         f"{self._epoch[slot]}, {'live' if self._live[slot] else 'free'})")
                if message.kind is MessageKind.RELEASE:
                    self._check_live(slot, epoch)
        elif message.kind is MessageKind.STEP:
            self._check_step(message)
        self.next_number += 1
        if message.kind is MessageKind.ALLOCATE:
            for slot, epoch in zip(message.slots.tolist(), message.epochs.tolist()):
                self._live[slot], self._epoch[slot] = True, epoch
        elif message.kind is MessageKind.RELEASE:
            for slot in message.slots.tolist():
                self._live[slot] = False

    def _check_step(self, message: StepMessage) -> None:
        forward = message.forward
        if forward is None:
            raise ValueError("a step message without a forward batch")
        if len(message.epochs) != forward.num_seqs:
            raise ValueError(f"{len(message.epochs)} epochs for {forward.num_seqs} rows")
        for slot, epoch in zip(forward.state_slots.tolist(), message.epochs.tolist()):
            if slot != NULL_SLOT or epoch != 0:
                self._check_live(slot, epoch)
        for slot in set(forward.keep_slots[forward.keep_slots >= 0].tolist()) | set(
                message.state_copies.reshape(-1).tolist()):
            self._check_index(slot)
            if not self._live[slot]:
                raise StaleStateSlot(f"state slot {slot} is not live")
        # a snapshot save may read a slot released since the forward that wrote it (its state is still there)
        for slot in message.state_saves[:, 0].tolist() + message.state_loads[:, 1].tolist():
            self._check_index(slot)

    def _check_index(self, slot: int) -> None:
        if not 0 < slot < len(self._live):
            raise ValueError(f"state slot {slot} is not one of 1 .. {len(self._live) - 1}")

    def _check_live(self, slot: int, epoch: int) -> None:
        self._check_index(slot)
        if not self._live[slot] or self._epoch[slot] != epoch:
            raise StaleStateSlot(f"state slot {slot} epoch {epoch} is not live (it holds {self._epoch[slot]}, "
                                 f"{'live' if self._live[slot] else 'free'})")
