"""The KV cache manager: the one place the device stages ask about KV memory.

The scheduler's questions are asked in terms of sequences and tokens (how many tokens of this prompt
are cached, can these tokens get slots, give this sequence's memory back); the block arithmetic,
reference counts and the pool behind them stay here. The stages never touch the pool, so prefix
caching or another eviction policy can change what the answers are without changing the stages.

Hybrid models also hold one recurrent state slot per sequence (pipeline/memory/state_slots.py): taken
with the sequence's first blocks, given back with them in `free`, so every path that ends or preempts
a sequence (which all call `free`) returns its slot too. Their prefixes resume only where a state snapshot was
taken (pipeline/memory/state_snapshots.py): a prompt takes the cached blocks up to the last one a snapshot ends,
and its state slot gets that snapshot when it is allocated.

Prefix caching (dense models): every full block a sequence computes gets its key (`register_computed`), and a
prompt about to start takes the longest keyed run of its own full blocks by reference (`take_cached_prefix`, the
lookups in pipeline/memory/prefix_hits.py),
so its prefill starts after them. The last token is always computed, for its logits: a prompt that is cached whole
and ends at a block boundary takes a copy of its last block (the device copies it before the step) and computes
only that token. Blocks go back last-first, so eviction eats prefixes from their ends.

KV tiers (pipeline/memory/kv_offload.py): with a host tier, an evicted keyed block is copied there first, and a
prompt's run of cached blocks continues into the host and disk tiers: those blocks are allocated, keyed and filled
by copies that the next step plan carries (``take_transfers``) and the runner runs before its forward.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pipeline.memory.block_hashes import extend_block_hashes
from pipeline.memory.kv_blocks import KVBlockPool
from pipeline.memory.block_transfers import BlockTransfers
from pipeline.memory.kv_offload import KVOffload
from pipeline.memory.prefix_hits import PrefixHits
from pipeline.memory.snapshot_positions import SnapshotSchedule, tail_block_key
from pipeline.memory.state_snapshots import SnapshotPool
from pipeline.memory.state_slots import SlotChanges, StateSlotPool

if TYPE_CHECKING:
    from pipeline.runner.step_plan import ScheduledChunk
    from pipeline.sequence import Sequence


class CacheManager:
    """Owns the KVBlockPool (and the state slot pool of hybrid models); every allocation, share and free
    of a sequence's blocks and state slot goes through it."""

    __slots__ = ("_pool", "_states", "prefix_caching", "prefix_queried_tokens", "prefix_hit_tokens", "offload",
                 "snapshots", "_pending", "_hits", "_schedule")

    def __init__(self, pool: KVBlockPool, state_slots: StateSlotPool | None = None,
                 prefix_caching: bool = True, offload: KVOffload | None = None,
                 snapshots: SnapshotPool | None = None) -> None:
        self._pool = pool
        self._states = state_slots
        # a hybrid model resumes a prefix only where a snapshot of its recurrent state was taken
        hybrid = state_slots is not None
        self.prefix_caching = prefix_caching and (not hybrid or (snapshots is not None and snapshots.capacity > 0))
        self.offload = offload if self.prefix_caching else None
        self.snapshots = snapshots if self.prefix_caching and hybrid else None
        if self.offload is not None:
            pool.on_evict = self.offload.save
        self._pending = BlockTransfers(None)  # device-side copies queued for the next plan (blocks, state restores)
        self._hits = PrefixHits(pool, self.offload, self.snapshots, self._pending) if self.prefix_caching else None
        self._schedule = SnapshotSchedule(self.snapshots, pool.block_size) if self.snapshots is not None else None
        self.prefix_queried_tokens = 0  # prompt tokens looked up (each start of a prompt)
        self.prefix_hit_tokens = 0  # of those, found cached

    @property
    def num_state_slots_used(self) -> int:
        return 0 if self._states is None else self._states.num_used

    @property
    def block_size(self) -> int:
        """Tokens per block (the planner's unit of memory)."""
        return self._pool.block_size

    @property
    def capacity(self) -> int:
        """Blocks a sequence could ever use (the pool minus its null block)."""
        return self._pool.capacity

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def num_used(self) -> int:
        return self._pool.num_used

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a cached prefix (counted in num_free)."""
        return self._pool.num_cached_free

    @property
    def prefix_evictions(self) -> int:
        return self._pool.evictions

    def take_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence holding nothing yet (a new prompt, or one preempted for recompute): the longest cached run
        of its prefix, counted computed (``PrefixHits.take``). Returns the tokens taken (0 with caching off)."""
        return self._hits.take(seq) if self._hits is not None else 0

    def take_transfers(self) -> BlockTransfers | None:
        """The copies queued since the last plan, for the plan being built (its runner runs them first): tier
        copies, device block copies, and the state snapshots of chunks the previous plan ended at a snapshot
        position (their states are there until this plan's forward) and restores into the state slots of prompts
        starting now."""
        transfers = self.offload.take_transfers() if self.offload is not None else None
        pending = self._pending
        copies = BlockTransfers(None, copies=pending.copies, state_loads=pending.state_loads,
                                state_copies=pending.state_copies)
        pending.copies, pending.state_loads, pending.state_copies = [], [], []
        if self._schedule is not None:
            copies.state_saves.extend(self._schedule.take_saves())
            self.snapshots.handed()
        if transfers is not None:
            transfers.copies, transfers.state_saves, transfers.state_loads, transfers.state_copies = (
                copies.copies, copies.state_saves, copies.state_loads, copies.state_copies)
            copies = transfers
        # the snapshots' host copies (demotions of the snapshots the saves above evicted, promotions)
        host = self.snapshots is not None and self.snapshots.take_copies(copies)
        if (copies is transfers or host or copies.copies or copies.state_saves or copies.state_loads
                or copies.state_copies):
            return copies
        return None

    def take_slot_changes(self) -> SlotChanges | None:
        """The state slots allocated and released since the last plan (expert-parallel workers' ledgers)."""
        return self._states.take_changes() if self._states is not None else None

    def keep_states(self, seq: Sequence, count: int) -> list[int] | None:
        """Hybrid models, for a verify row: ``count`` spare slots of the sequence's own (taken on first use, kept
        until it ends) that receive its state after each of the row's first ``count`` tokens, so a rejected draft is
        undone by copying one back (``restore_kept``). None when the slots are not free (the row drafts nothing)."""
        while len(seq.spare_slots) < count:
            slot = self._states.allocate()
            if slot is None:
                return None
            seq.spare_slots.append(slot)
        return [slot.index for slot in seq.spare_slots[:count]]

    def keepable(self, seq: Sequence) -> int:
        """How many states a verify row of the sequence can keep (its spare slots and the free ones)."""
        return len(seq.spare_slots) + self._states.num_free

    def restore_kept(self, seq: Sequence, token: int) -> None:
        """The state kept after the verify row's token ``token`` goes into the sequence's slot before the next
        step's forward (the row went on past drafts that were rejected)."""
        self._pending.state_copies.append((seq.spare_slots[token].index, seq.state_slot.index))

    @property
    def has_state_slots(self) -> bool:
        return self._states is not None

    def prompt_stop(self, seq: Sequence) -> int:
        """Where the sequence's next prompt chunk must end at the latest: its end, or for hybrid models a snapshot
        position before it (``SnapshotSchedule.prompt_stop``)."""
        return len(seq.token_ids) if self._schedule is None else self._schedule.prompt_stop(seq)

    def snapshot_after_chunk(self, seq: Sequence, end: int) -> None:
        """A chunk of the plan being built ends the sequence's computed tokens at ``end`` (hybrid models: a state
        snapshot there if that is a snapshot position, ``SnapshotSchedule.after_chunk``)."""
        if self._schedule is not None:
            self._schedule.after_chunk(seq, end)

    def count_prefix_query(self, seq: Sequence) -> None:
        """A prompt starts: its tokens were looked up, its computed ones were found (metrics)."""
        self.prefix_queried_tokens += len(seq.token_ids)
        self.prefix_hit_tokens += seq.num_computed

    def register_computed(self, seq: Sequence) -> None:
        """Key every full block of the sequence's computed tokens (a later prompt with this prefix may take it)."""
        full = seq.num_computed // self._pool.block_size
        if not self.prefix_caching or full <= seq.num_keyed:
            return
        keys = extend_block_hashes(seq.block_keys, seq.token_ids, self._pool.block_size, full,
                                   seq.request.params.cache_salt)
        for i in range(seq.num_keyed, full):
            self._pool.register(seq.block_ids[i], keys[i])
        seq.num_keyed = full

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> int:
        """Blocks to add so that seq.block_ids covers its computed tokens, `num_new_tokens` more, and
        `num_lookahead` tokens beyond them (sampled on the device, not yet seen by the host); 0 if
        already covered."""
        size = self._pool.block_size
        total = seq.num_computed + num_new_tokens + num_lookahead
        return max(0, -(-total // size) - len(seq.block_ids))

    def blocks_released(self, seq: Sequence) -> int:
        """Blocks that freeing the sequence returns to the pool: those it holds alone (a prefix block it shares with
        another holder stays allocated)."""
        refcount = self._pool.refcount
        return sum(1 for block in seq.block_ids if refcount(block) == 1)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """Append exactly blocks_needed(...) blocks to seq.block_ids. All or nothing: False, with
        nothing allocated, when they do not fit (the caller preempts or waits)."""
        pool = self._pool
        total = seq.num_computed + num_new_tokens + num_lookahead
        count = -(-total // pool.block_size) - len(seq.block_ids)
        if count > pool.num_free:
            return False
        if self._states is not None and seq.state_slot is None:
            seq.state_slot = self._states.allocate()
            if seq.state_slot is None:
                return False
            if seq.restore_from is not None:  # the cached prefix's state, before this plan's forward
                snapshot, seq.restore_from = seq.restore_from, None
                self._pending.state_loads.append((self.snapshots.read(snapshot), seq.state_slot.index))
        if count > 0:
            seq.block_ids.extend(pool.allocate(count))
        return True

    def preempt(self, seq: Sequence) -> None:
        """A running sequence gives its memory back, to resume later. With a host tier its computed tokens are
        swapped out first: its full blocks to the tier under their prefix keys, its partial last block under a key
        of its own (``tail_block_key``) and, for hybrid models, its state into a snapshot under that key (or the last
        full block's); ``_swap_in`` takes them back. Where there is no room, what is missing is recomputed."""
        if self.offload is not None and seq.num_computed:
            self.register_computed(seq)
            size = self._pool.block_size
            full = seq.num_computed // size
            keys = seq.block_keys[:full]
            tail_key = tail_block_key(seq, keys, seq.token_ids[full * size:seq.num_computed])
            if tail_key is not None:
                self.offload.save(seq.block_ids[full], tail_key)
            for block, key in reversed(list(zip(seq.block_ids[:full], keys))):  # last first, as the pool evicts:
                self.offload.save(block, key)  # a host without room for them all keeps the first ones
            state_key = tail_key or (keys[-1] if keys else None)
            if self.snapshots is not None and seq.state_slot is not None and state_key is not None:
                self._schedule.after_preempt(seq.state_slot.index, state_key)
            self.offload.stats.swapped_out += 1
        self.free(seq)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references to its blocks (shared ones stay with their other holders);
        it keeps its tokens, so it can be recomputed from scratch."""
        if seq.state_slot is not None:
            slot, seq.state_slot = seq.state_slot, None
            self._states.free(slot)
        for spare in seq.spare_slots:
            self._states.free(spare)
        seq.spare_slots = []
        if seq.restore_from is not None:
            self.snapshots.unpin(seq.restore_from)
            seq.restore_from = None
        seq.snapshot_pos = 0
        if seq.block_ids:
            blocks, seq.block_ids = seq.block_ids, []
            self._pool.free(blocks[::-1])  # cached ones: the prefix's end is evicted first
        seq.num_computed = seq.num_keyed = 0

    def share_prompt(self, parent: Sequence) -> list[int]:
        """A new reference to each full block of the parent's computed prompt, for a sibling sample
        (n > 1). Only full blocks: no block is ever written by two sequences, so no copy-on-write;
        the sibling recomputes the partial tail. Freed with free(sibling) like its own blocks.

        Hybrid models share nothing: a recurrent state cannot start mid-prompt without a snapshot of the
        parent's state there, so the sibling recomputes its whole prompt into its own slot."""
        if self._states is not None:
            return []
        full = parent.num_prompt_tokens // self._pool.block_size
        return self._pool.share(parent.block_ids[:full])

    def state_slot_indices(self, chunks: list[ScheduledChunk]) -> list[int] | None:
        """Each chunk's state slot index, checked live under the chunk's epoch (StaleStateSlot if not: a
        continuation planned before its sequence's slot was freed and reused); None without state slots."""
        if self._states is None:
            return None
        indices = []
        for chunk in chunks:
            if chunk.state_slot is None:
                raise ValueError("a chunk of a hybrid model carries no state slot")
            indices.append(self._states.check(chunk.state_slot))
        return indices

    def add_free_listener(self, listener: Callable[[], None]) -> None:
        """Called after every free of a non-empty block list (a sequence ended or was preempted:
        stages waiting for memory or seats wake up and re-check)."""
        self._pool.add_free_listener(listener)
