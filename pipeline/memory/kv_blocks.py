"""The paged KV block pool: reference-counted blocks shared by every stage that touches the device.

Block 0 is reserved as the null block: padded slots (CUDA-graph padding, unused block-table
entries) point at it, so a write there can never corrupt a live sequence.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

NULL_BLOCK = 0


class OutOfBlocks(Exception):
    """Raised by allocate() when the pool cannot satisfy a request; the caller preempts or waits."""


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._refcount = [0] * num_blocks
        self._on_free: list[Callable[[], None]] = []

    @property
    def capacity(self) -> int:
        """Blocks a sequence could ever use (everything but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._refcount[block] = 1
        return blocks

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
                self._free.append(block)
        if blocks:  # even a release of shared blocks means a sequence ended: waiters re-check
            for listener in self._on_free:
                listener()

    def add_free_listener(self, listener: Callable[[], None]) -> None:
        """Called after every free (stages waiting for memory or seats wake up and re-check)."""
        self._on_free.append(listener)

    def refcount(self, block: int) -> int:
        return self._refcount[block]
