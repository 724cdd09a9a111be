"""Where a hybrid sequence's recurrent state is snapshotted, and which plan copies it.

A snapshot (pipeline/memory/state_snapshots.py) can only be taken where a sequence's computed tokens end after a
step, so the prefill stage asks where a prompt chunk must stop (``prompt_stop``) and reports where each chunk ends
(``after_chunk``). A state is in its slot from the end of the step that computed it until the next forward over
that sequence: a chunk planned now is computed by the plan being built, so its snapshot rides in the plan after it;
a preempted sequence's state (computed already) rides in the next one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.memory.block_hashes import chain_root, extend_block_hashes, partial_block_key

if TYPE_CHECKING:
    from pipeline.memory.state_snapshots import SnapshotPool
    from pipeline.sequence import Sequence


def tail_block_key(seq: Sequence, keys: list[bytes], tail: list[int]) -> bytes | None:
    """The key of a partial block ``tail`` after the full blocks ``keys``: what a swapped-out sequence's partial
    last block (and state, hybrid) is kept under, and a block-aligned prompt's state one token before its end."""
    if not tail:
        return None
    return partial_block_key(keys[-1] if keys else chain_root(seq.request.params.cache_salt), tail)


class SnapshotSchedule:
    __slots__ = ("snapshots", "block_size", "_next", "_after_step")

    def __init__(self, snapshots: SnapshotPool, block_size: int) -> None:
        self.snapshots = snapshots
        self.block_size = block_size
        self._next: list[tuple[int, bytes]] = []  # (state slot, key): snapshots the next plan takes
        self._after_step: list[tuple[int, bytes]] = []  # the same, of the plan being built (the one after)

    def prompt_stop(self, seq: Sequence) -> int:
        """Where the sequence's next prompt chunk must end at the latest: its prompt's last full block, before the
        tokens after it; one token before the end of a prompt that ends at a block boundary (its exact repeat
        restores that state and computes one token); else its end."""
        end, size = len(seq.token_ids), self.block_size
        aligned = end // size * size
        if seq.num_computed < aligned < end:
            return aligned
        if aligned == end and size > 1 and seq.num_computed < end - 1:
            return end - 1
        return end

    def after_chunk(self, seq: Sequence, end: int) -> None:
        """A chunk of the plan being built ends the sequence's computed tokens at ``end``: snapshot its state there
        (after the step) if that is a snapshot position: its prompt's last full block, a block boundary at least
        the pool's interval after its last snapshot, or one token before the end of a block-aligned prompt (under
        the key of the partial block it ends)."""
        size, total = self.block_size, len(seq.token_ids)
        if end <= seq.snapshot_pos or seq.state_slot is None:
            return
        salt = seq.request.params.cache_salt
        if end % size:
            if total % size or end != total - 1:
                return
            keys = extend_block_hashes(seq.block_keys, seq.token_ids, size, end // size, salt)
            key = tail_block_key(seq, keys[:end // size], seq.token_ids[end // size * size:end])
        else:
            if end != total // size * size and end - seq.snapshot_pos < self.snapshots.interval:
                return
            key = extend_block_hashes(seq.block_keys, seq.token_ids, size, end // size, salt)[end // size - 1]
        self._after_step.append((seq.state_slot.index, key))
        seq.snapshot_pos = end

    def after_preempt(self, slot: int, key: bytes) -> None:
        """A preempted sequence's state, computed already: the next plan copies it, before its slot is reused."""
        self._next.append((slot, key))

    def take_saves(self) -> list[tuple[int, int]]:
        """(state slot, snapshot) copies for the plan being built; the chunks it computes wait for the next one."""
        saves = []
        for slot, key in self._next:
            index = self.snapshots.reserve(key)
            if index is not None:
                saves.append((slot, index))
        self._next, self._after_step = self._after_step, []
        return saves
