"""The KV cache manager: the one place the device stages ask about KV memory.

The scheduler's questions are asked in terms of sequences and tokens (how many tokens of this prompt
are cached, can these tokens get slots, give this sequence's memory back); the block arithmetic,
reference counts and the pool behind them stay here. The stages never touch the pool, so prefix
caching or another eviction policy can change what the answers are without changing the stages.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pipeline.memory.kv_blocks import KVBlockPool

if TYPE_CHECKING:
    from pipeline.sequence import Sequence


class CacheManager:
    """Owns the KVBlockPool; every allocation, share and free of a sequence's blocks goes through it."""

    __slots__ = ("_pool",)

    def __init__(self, pool: KVBlockPool) -> None:
        self._pool = pool

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

    def cached_tokens(self, seq: Sequence) -> int:
        """Tokens at the start of `seq`'s prompt whose K/V are already in the cache and need no compute.

        Always 0 until prefix caching: then it will be the length of the longest run of full blocks
        of this prompt that another sequence left in the cache (a multiple of block_size), which
        prefill can take by reference instead of computing.
        """
        return 0

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> int:
        """Blocks to add so that seq.block_ids covers its computed tokens, `num_new_tokens` more, and
        `num_lookahead` tokens beyond them (sampled on the device, not yet seen by the host); 0 if
        already covered."""
        size = self._pool.block_size
        total = seq.num_computed + num_new_tokens + num_lookahead
        return max(0, -(-total // size) - len(seq.block_ids))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """Append exactly blocks_needed(...) blocks to seq.block_ids. All or nothing: False, with
        nothing allocated, when they do not fit (the caller preempts or waits)."""
        pool = self._pool
        total = seq.num_computed + num_new_tokens + num_lookahead
        count = -(-total // pool.block_size) - len(seq.block_ids)
        if count <= 0:
            return True
        if count > pool.num_free:
            return False
        seq.block_ids.extend(pool.allocate(count))
        return True

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references to its blocks (shared ones stay with their other holders);
        it keeps its tokens, so it can be recomputed from scratch."""
        if seq.block_ids:
            blocks, seq.block_ids = seq.block_ids, []
            self._pool.free(blocks)
        seq.num_computed = 0

    def share_prompt(self, parent: Sequence) -> list[int]:
        """A new reference to each full block of the parent's computed prompt, for a sibling sample
        (n > 1). Only full blocks: no block is ever written by two sequences, so no copy-on-write;
        the sibling recomputes the partial tail. Freed with free(sibling) like its own blocks."""
        full = parent.num_prompt_tokens // self._pool.block_size
        return self._pool.share(parent.block_ids[:full])

    def add_free_listener(self, listener: Callable[[], None]) -> None:
        """Called after every free of a non-empty block list (a sequence ended or was preempted:
        stages waiting for memory or seats wake up and re-check)."""
        self._pool.add_free_listener(listener)
