"""Prefix hits: how a prompt about to start takes the cached blocks of its prefix, across the device pool, the host
and disk tiers (pipeline/memory/kv_offload.py) and, for hybrid models, the state snapshots
(pipeline/memory/state_snapshots.py). The cache manager (pipeline/memory/cache_manager.py) asks; the blocks a hit
takes are the sequence's from then on, and the device copies it needs (a whole prompt's last block, restored blocks,
a snapshot's state) join the manager's pending copies for the next plan.
"""
from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING

from pipeline.memory.block_hashes import extend_block_hashes
from pipeline.memory.kv_blocks import KVBlockPool
from pipeline.memory.block_transfers import BlockTransfers
from pipeline.memory.kv_offload import KVOffload
from pipeline.memory.snapshot_positions import tail_block_key
from pipeline.memory.state_snapshots import SnapshotPool

if TYPE_CHECKING:
    from pipeline.sequence import Sequence


class PrefixHits:
    """The lookups of a prefix-caching cache manager; ``pending`` is the manager's queue of device copies for the
    next plan (this appends to it, the manager drains it)."""

    __slots__ = ("_pool", "offload", "snapshots", "_pending")

    def __init__(self, pool: KVBlockPool, offload: KVOffload | None, snapshots: SnapshotPool | None,
                 pending: BlockTransfers) -> None:
        self._pool = pool
        self.offload = offload
        self.snapshots = snapshots
        self._pending = pending

    def take(self, seq: Sequence) -> int:
        """For a sequence holding nothing yet (a new prompt, or one preempted for recompute): take the longest run
        of its full blocks that the cache holds, up to the block before its last token, and count them computed;
        a whole prompt cached up to a block boundary also takes a copy of its last block, all but its last token
        computed (``_copy_last_block``). Returns the tokens taken (0 with blocks already held)."""
        if seq.block_ids or seq.num_computed or seq.missed_at == self.version():
            return 0
        size = self._pool.block_size
        tokens = seq.token_ids
        limit = (len(tokens) - 1) // size
        whole = len(tokens) % size == 0  # the prompt's last block is full: a whole-prompt hit needs its copy
        keys = extend_block_hashes(seq.block_keys, tokens, size, limit + whole, seq.request.params.cache_salt)
        run = self._pool.lookup(islice(keys, limit))
        swapped = self._swap_in(seq, keys[:limit], run) if seq.preemptions and self.offload is not None else None
        if swapped is not None:
            blocks, computed = swapped
        elif self.snapshots is not None:
            taken = self._take_whole_prompt(seq, keys[:limit + 1], run) if whole else None
            if taken is None and whole:
                run = self._pool.lookup(keys[:limit])  # it may have restored some
            blocks = taken if taken is not None else self._take_to_snapshot(seq, keys[:limit], run)
            computed = len(tokens) - 1 if taken is not None else len(blocks) * size
        else:
            blocks = self._pool.acquire(run)
            if self.offload is not None and len(blocks) < limit:
                blocks += self._restore(keys[len(blocks):limit])
            computed = len(blocks) * size
            if whole and len(blocks) == limit and (last := self._copy_last_block(keys[limit])) is not None:
                blocks.append(last)
                computed = len(tokens) - 1
        if not blocks:
            seq.missed_at = self.version()
        seq.block_ids = blocks
        seq.num_keyed = min(len(blocks), limit)
        seq.num_computed = computed
        return seq.num_computed

    def _take_whole_prompt(self, seq: Sequence, keys: list[bytes], run: list[int]) -> list[int] | None:
        """Hybrid models: a block-aligned prompt (``keys``: its every block's) cached whole (device or tiers), with
        the snapshot of its state one token before its end (``snapshot_after_chunk`` takes it): its blocks, a copy
        of its last block, that snapshot pinned; only the last token is computed, and the state advances over it
        once. None otherwise."""
        size, tokens = self._pool.block_size, seq.token_ids
        keys, last_key = keys[:-1], keys[-1]
        key = tail_block_key(seq, keys, tokens[len(keys) * size:-1])
        if key is None or key not in self.snapshots:
            return None
        tiers = self.offload.reach(keys[len(run):]) if self.offload is not None and len(run) < len(keys) else 0
        if len(run) + tiers < len(keys) or (snapshot := self.snapshots.pin(key)) is None:
            return None
        blocks = self._pool.acquire(run)
        if len(blocks) < len(keys):
            blocks += self._restore(keys[len(blocks):])
        last = self._copy_last_block(last_key) if len(blocks) == len(keys) else None
        if last is None:  # restored blocks stay cached, their copies queued
            self._pool.free(blocks[::-1])
            self.snapshots.unpin(snapshot)
            return None
        seq.restore_from = snapshot
        seq.snapshot_pos = len(tokens) - 1
        return blocks + [last]

    def _copy_last_block(self, key: bytes) -> int | None:
        """An exact full-prompt hit that ends at a block boundary (dense models): a block of the sequence's own
        holding a copy of the prompt's cached last block (``key``), so only the last token is computed again, for
        its logits, and rewritten in the copy, never in the block other holders read. None when the block is in
        no tier or no block is free (the whole last block is computed then)."""
        run = self._pool.lookup([key])
        if run and (self.offload is None or not self.offload.loading(run[0])):
            if self._pool.num_free < 1 + (self._pool.refcount(run[0]) == 0):
                return None
            source = self._pool.acquire(run)  # held while a block is allocated: that allocation cannot evict it
            block = self._pool.allocate(1)[0]
            self._pool.free(source)  # copied before any later holder writes it (BlockTransfers' order)
            self._pending.copies.append((source[0], block))
            return block
        if not run and self.offload is not None:
            restored = self._restore([key], key_blocks=False)
            return restored[0] if restored else None
        return None

    def _swap_in(self, seq: Sequence, keys: list[bytes], run: list[int]) -> tuple[list[int], int] | None:
        """A preempted sequence swapped out (``preempt``) takes back every computed token: its full blocks (device
        or tiers), its partial last block and, for hybrid models, its state, all or nothing. Returns the blocks
        and the tokens they hold, or None (something is gone: the ordinary lookup then takes what is left)."""
        size, tokens = self._pool.block_size, seq.token_ids
        limit = len(keys)
        tail = tokens[limit * size:len(tokens) - 1]
        tail_key = tail_block_key(seq, keys, tail)
        state_key = tail_key or (keys[-1] if keys else None)
        if (len(run) + self.offload.reach(keys[len(run):]) < limit
                or (tail_key is not None and not self.offload.reach([tail_key]))
                or (self.snapshots is not None and (state_key is None or state_key not in self.snapshots))
                or self._pool.num_free < limit - len(run) + bool(tail)):
            return None
        snapshot = self.snapshots.pin(state_key) if self.snapshots is not None else None
        if self.snapshots is not None and snapshot is None:  # on host, and no device snapshot to promote it to
            return None
        blocks = self._pool.acquire(run) + self._restore(keys[len(run):])
        if tail_key is not None:
            blocks += self._restore([tail_key], key_blocks=False)  # written again: its last token comes next
        if len(blocks) < limit + bool(tail):  # a tier failed a block (a corrupt file): give them all back
            self._pool.free(blocks[::-1])
            if snapshot is not None:
                self.snapshots.unpin(snapshot)
            return None
        if snapshot is not None:
            seq.restore_from = snapshot
            seq.snapshot_pos = limit * size
        self.offload.stats.swapped_in += 1
        return blocks, limit * size + len(tail)

    def _take_to_snapshot(self, seq: Sequence, keys: list[bytes], run: list[int]) -> list[int]:
        """Hybrid models: the prompt's cached blocks (the device's ``run``, then the lower tiers') up to the last
        one a snapshot ends, that snapshot pinned for the sequence's state slot."""
        reach = len(run) + (self.offload.reach(keys[len(run):]) if self.offload is not None else 0)
        cut = self.snapshots.latest(keys[:reach])
        blocks = self._pool.acquire(run[:cut])
        if len(blocks) < cut:
            blocks += self._restore(keys[len(blocks):cut])
            if len(blocks) < cut:  # a lower tier lost some: back to the last snapshot the blocks reach
                cut = self.snapshots.latest(keys[:len(blocks)])
        snapshot = None
        while cut and (snapshot := self.snapshots.pin(keys[cut - 1])) is None:  # a host one with no device room
            cut = self.snapshots.latest(keys[:cut - 1])
        if len(blocks) > cut:
            self._pool.free(blocks[cut:][::-1])
            blocks = blocks[:cut]
        if snapshot is not None:
            seq.restore_from = snapshot
            seq.snapshot_pos = cut * self._pool.block_size
        return blocks

    def _restore(self, keys: list[bytes], key_blocks: bool = True) -> list[int]:
        """Fresh device blocks for the leading ``keys`` the lower tiers hold, their copies queued; keyed (a partial
        block is not: its holder writes it again)."""
        blocks: list[int] = []
        for key in keys[:self.offload.reach(keys)]:
            if self._pool.num_free == 0:
                break
            block = self._pool.allocate(1)[0]  # may evict (and save) another cached block
            if not self.offload.restore(key, block):
                self._pool.free([block])
                break
            if key_blocks:
                self._pool.register(block, key)
            blocks.append(block)
        return blocks

    def version(self) -> int:
        """Grows whenever a lookup that missed might now hit (a block keyed, or saved to the host tier: a drop may
        be a later block taking an earlier one's slot)."""
        stats = self.offload.stats if self.offload is not None else None
        saved = stats.saved_blocks + stats.dropped_blocks if stats is not None else 0
        snapshots = self.snapshots.stats.taken if self.snapshots is not None else 0
        return self._pool.keys_added + saved + snapshots
