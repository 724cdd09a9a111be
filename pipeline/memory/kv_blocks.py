"""The paged KV block pool: reference-counted blocks shared by every stage that touches the device.

Block 0 is reserved as the null block: padded slots (CUDA-graph padding, unused block-table
entries) point at it, so a write there can never corrupt a live sequence.

Prefix cache: a full block whose tokens are known may carry its key (pipeline/memory/block_hashes.py). When its
last holder frees it, a keyed block is not forgotten: it waits in an LRU list of cached free blocks, still
counted as free, and a later prompt with the same prefix takes it back (``acquire``) instead of recomputing it.
Allocation takes never-keyed free blocks first, then evicts the least recently freed cached ones. A keyed block
is never written again: its holders only append after it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

NULL_BLOCK = 0


class OutOfBlocks(Exception):
    """Raised by allocate() when the pool cannot satisfy a request; the caller preempts or waits."""


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))  # free and keyless
        self._cached: OrderedDict[int, None] = OrderedDict()  # free and keyed, least recently freed first
        self._refcount = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._on_free: list[Callable[[], None]] = []
        self.on_evict: Callable[[int, bytes], None] | None = None  # (block, key) before a cached block is reused
        self.evictions = 0  # cached blocks given to a new holder (their keys dropped)
        self.keys_added = 0  # blocks keyed so far: a lookup that missed can only hit after this grows

    @property
    def capacity(self) -> int:
        """Blocks a sequence could ever use (everything but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks a new holder can take: keyless free ones and cached ones (evicted when taken)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks still holding a prefix a later prompt may take back."""
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfBlocks(f"need {count} blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:  # evict the least recently freed cached block
                block, _ = self._cached.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(block, self._key[block])
                del self._block_of[self._key[block]]
                self._key[block] = None
                self.evictions += 1
            self._refcount[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """The blocks holding the longest run of ``keys`` from the first (used or cached); not taken."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, blocks: Sequence[int]) -> list[int]:
        """A reference to each keyed block (``lookup``'s), taking cached free ones out of the LRU list."""
        for block in blocks:
            if self._key[block] is None:
                raise ValueError(f"block {block} holds no cached prefix")
            if self._refcount[block] == 0:
                del self._cached[block]
            self._refcount[block] += 1
        return list(blocks)

    def register(self, block: int, key: bytes) -> None:
        """Give a full, computed block its key. A block keyed already keeps its key; a key held by another block
        stays with that one (two sequences computed the same prefix at once: the later copy is not cached)."""
        if self._refcount[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        if self._key[block] is None and key not in self._block_of:
            self._key[block] = key
            self._block_of[key] = block
            self.keys_added += 1

    def share(self, blocks: Sequence[int]) -> list[int]:
        """Add a reference to each block (a forked sample shares its parent's full prompt blocks)."""
        for block in blocks:
            if self._refcount[block] <= 0:
                raise ValueError(f"block {block} is not allocated")
            self._refcount[block] += 1
        return list(blocks)

    def free(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            count = self._refcount[block]
            if count <= 0:
                raise ValueError(f"double free of block {block}")
            self._refcount[block] = count - 1
            if count == 1:
                if self._key[block] is None:
                    self._free.append(block)
                else:
                    self._cached[block] = None  # most recently freed: evicted last
        if blocks:  # even a release of shared blocks means a sequence ended: waiters re-check
            for listener in self._on_free:
                listener()

    def add_free_listener(self, listener: Callable[[], None]) -> None:
        """Called after every free (stages waiting for memory or seats wake up and re-check)."""
        self._on_free.append(listener)

    def refcount(self, block: int) -> int:
        return self._refcount[block]
