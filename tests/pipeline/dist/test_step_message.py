"""The head's messages to the expert-parallel workers (pipeline/dist/step_message.py): they round-trip as bytes,
another layout version is refused, and a worker's ledger refuses steps and copies under stale slot epochs and
messages out of sequence."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.memory.state_slots import NULL_SLOT, StaleStateSlot, StateSlot
from pipeline.dist.step_message import (
    STEP_MESSAGE_VERSION,
    MessageKind,
    OutOfSequence,
    SlotLedger,
    StepMessage,
    StepMessageVersionError,
)
from pipeline.runner.step_plan import ScheduledChunk, build_step_plan


def step(number: int, slots: list[StateSlot | None], keeps: list[int] | None = None,
         copies: list[tuple[int, int]] = ()) -> StepMessage:
    """A step of one row a slot (None: a row without state): a verify row of three tokens for the first."""
    chunks = [ScheduledChunk([5, 6, 7] if i == 0 else [9], 8 + i, [1, 2, 3], ["r"], state_slot=slot,
                             keep_slots=keeps if i == 0 else None) for i, slot in enumerate(slots)]
    plan = build_step_plan(chunks, 4, [NULL_SLOT if s is None else s.index for s in slots])
    epochs = np.array([0 if s is None else s.epoch for s in slots], dtype=np.int64)
    return StepMessage(MessageKind.STEP, number, epochs=epochs,
                       state_copies=np.array(copies, dtype=np.int32).reshape(-1, 2),
                       block_copies=np.array([[4, 7]], dtype=np.int32), loaded_blocks=np.array([9, 2]),
                       loaded_snapshots=np.array([1]), state_saves=np.array([[3, 0]]), state_loads=np.array([[1, 6]]),
                       fed_tokens=3, forward=plan.forward)


def lives(kind: MessageKind, number: int, slots: list[StateSlot]) -> StepMessage:
    return StepMessage(kind, number, np.array([s.index for s in slots], dtype=np.int32),
                       np.array([s.epoch for s in slots], dtype=np.int64))


def test_messages_round_trip_as_bytes():
    a, b = StateSlot(3, 7), StateSlot(5, 9)
    for message in (lives(MessageKind.ALLOCATE, 0, [a, b]), step(1, [a, None, b], keeps=[6, 8, -1], copies=[(6, 3)]),
                    lives(MessageKind.RELEASE, 2, [a]), StepMessage(MessageKind.STOP, 3)):
        back = StepMessage.from_bytes(message.to_bytes())
        assert (back.kind, back.number, back.fed_tokens) == (message.kind, message.number, message.fed_tokens)
        for name in ("slots", "epochs", "block_copies", "loaded_blocks", "loaded_snapshots", "state_copies",
                     "state_saves", "state_loads"):
            assert np.array_equal(getattr(back, name), getattr(message, name)), name
        if message.forward is None:
            assert back.forward is None
        else:
            assert back.forward.to_bytes() == message.forward.to_bytes()
            assert back.forward.keep_slots.tolist() == [6, 8, -1, -1, -1]


def test_another_version_is_refused():
    data = bytearray(lives(MessageKind.ALLOCATE, 0, [StateSlot(1, 1)]).to_bytes())
    data[:8] = np.array([STEP_MESSAGE_VERSION + 1], dtype=np.int64).tobytes()
    with pytest.raises(StepMessageVersionError, match="version"):
        StepMessage.from_bytes(bytes(data))
    with pytest.raises(ValueError, match="bytes"):
        StepMessage.from_bytes(lives(MessageKind.ALLOCATE, 0, [StateSlot(1, 1)]).to_bytes() + b"\0" * 4)


def test_the_ledger_refuses_stale_epochs_and_messages_out_of_sequence():
    ledger = SlotLedger(num_slots=8)
    old, new, spare = StateSlot(3, 7), StateSlot(3, 12), StateSlot(6, 8)
    ledger.accept(lives(MessageKind.ALLOCATE, 0, [old, spare]))
    ledger.accept(step(1, [old, None], keeps=[6, 6, -1], copies=[(6, 3)]))
    with pytest.raises(OutOfSequence):
        ledger.accept(step(1, [old]))  # repeated
    ledger.accept(lives(MessageKind.RELEASE, 2, [old]))
    with pytest.raises(StaleStateSlot):
        ledger.accept(step(3, [old]))  # its slot was given back
    with pytest.raises(StaleStateSlot):
        ledger.accept(lives(MessageKind.RELEASE, 3, [old]))  # a double release
    ledger.accept(lives(MessageKind.ALLOCATE, 3, [new]))  # the slot's next owner
    with pytest.raises(StaleStateSlot):
        ledger.accept(step(4, [old]))  # a row planned for the old owner
    with pytest.raises(StaleStateSlot):
        ledger.accept(lives(MessageKind.ALLOCATE, 4, [StateSlot(3, 13)]))  # live already
    with pytest.raises(StaleStateSlot):
        ledger.accept(step(4, [new], keeps=[5, 6, -1]))  # keeps into a slot nobody holds
    with pytest.raises(ValueError, match="not one of"):
        ledger.accept(lives(MessageKind.ALLOCATE, 4, [StateSlot(NULL_SLOT, 20)]))  # the null slot is never given
    ledger.accept(step(4, [new, None], keeps=[6, 6, -1]))
    assert ledger.next_number == 5


def test_the_pool_reports_slot_changes_net_between_plans():
    """What a plan tells the workers: a slot allocated and released before any plan saw it is left out; a slot
    released and given to another sequence appears in both lists, under its two epochs."""
    from pipeline.memory.state_slots import StateSlotPool

    pool = StateSlotPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert pool.take_changes().allocated == [a, b]
    pool.free(a)
    c = pool.allocate()  # slot 3 (the free list is first in, first out), then a's slot under a new epoch
    d = pool.allocate()
    pool.free(c)
    changes = pool.take_changes()
    assert changes.released == [a] and changes.allocated == [d] and d.index == a.index and d.epoch > a.epoch
    assert not pool.take_changes()
