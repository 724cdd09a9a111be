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

STEP_MESSAGE_VERSION = 1


class StepMessageVersionError(ValueError):
    """A message of another layout version (ranks running different code)."""


class OutOfSequence(RuntimeError):
    """A message whose number is not the next one (lost, repeated or reordered)."""


class MessageKind(IntEnum):
    STEP = 1  # copies, then a forward
    ALLOCATE = 2  # state slots given to sequences, under new epochs
    RELEASE = 3  # state slots given back
    STOP = 4  # the head is shutting down


def _empty_pairs() -> np.ndarray:
    return np.zeros((0, 2), dtype=np.int32)


@dataclass(frozen=True, slots=True)
class StepMessage:
    kind: MessageKind
    number: int  # messages count from 0 without gaps
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # ALLOCATE / RELEASE
    epochs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # per slot; STEP: per row
    block_copies: np.ndarray = field(default_factory=_empty_pairs)  # int32 [n, 2]: (source, destination) blocks
    state_copies: np.ndarray = field(default_factory=_empty_pairs)  # int32 [n, 2]: (source, destination) slots
    forward: ForwardBatch | None = None  # STEP

    def to_bytes(self) -> bytes:
        forward = b"" if self.forward is None else self.forward.to_bytes()
        header = np.array([STEP_MESSAGE_VERSION, int(self.kind), self.number, len(self.slots), len(self.epochs),
                           len(self.block_copies), len(self.state_copies), len(forward)], dtype=np.int64)
        return b"".join([header.tobytes(), np.ascontiguousarray(self.slots, dtype=np.int32).tobytes(),
                         np.ascontiguousarray(self.epochs, dtype=np.int64).tobytes(),
                         np.ascontiguousarray(self.block_copies, dtype=np.int32).tobytes(),
                         np.ascontiguousarray(self.state_copies, dtype=np.int32).tobytes(), forward])

    @classmethod
    def from_bytes(cls, data: bytes) -> StepMessage:
        header = np.frombuffer(data, dtype=np.int64, count=8)
        if int(header[0]) != STEP_MESSAGE_VERSION:
            raise StepMessageVersionError(f"step message version {int(header[0])}, this rank reads "
                                          f"{STEP_MESSAGE_VERSION}")
        kind, number, n_slots, n_epochs, n_blocks, n_states, n_forward = (int(x) for x in header[1:])
        offset = header.nbytes

        def take(dtype: type, count: int, shape: tuple[int, ...]) -> np.ndarray:
            nonlocal offset
            array = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape).copy()
            offset += count * np.dtype(dtype).itemsize
            return array

        slots = take(np.int32, n_slots, (n_slots,))
        epochs = take(np.int64, n_epochs, (n_epochs,))
        blocks = take(np.int32, 2 * n_blocks, (n_blocks, 2))
        states = take(np.int32, 2 * n_states, (n_states, 2))
        forward = ForwardBatch.from_bytes(data[offset:offset + n_forward]) if n_forward else None
        if offset + n_forward != len(data):
            raise ValueError(f"step message of {len(data)} bytes, its header describes {offset + n_forward}")
        return cls(MessageKind(kind), number, slots, epochs, blocks, states, forward)


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

    def _check_index(self, slot: int) -> None:
        if not 0 < slot < len(self._live):
            raise ValueError(f"state slot {slot} is not one of 1 .. {len(self._live) - 1}")

    def _check_live(self, slot: int, epoch: int) -> None:
        self._check_index(slot)
        if not self._live[slot] or self._epoch[slot] != epoch:
            raise StaleStateSlot(f"state slot {slot} epoch {epoch} is not live (it holds {self._epoch[slot]}, "
                                 f"{'live' if self._live[slot] else 'free'})")
