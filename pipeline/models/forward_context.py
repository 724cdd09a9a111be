"""What every layer of one forward reads besides its input: the step's layout and the caches.

A layer takes `(x, residual, ctx)` and finds what it needs here: attention layers their paged KV
cache by `cache_index` and the step's attention metadata; recurrent (Gated DeltaNet) layers their
per-sequence state tensors by cache index and each row's state slot (`state_slots`). Adding a kind
of layer adds a field, not an argument to every layer's signature.

The model declares the caches it needs (`cache_specs()`: one spec per cache, in cache-index order);
the model runner allocates them and hands them in through the context, so the runner does not know
a model's layer kinds. Paged specs are sized by the KV block count, state specs by the number of
state slots (one per sequence that can run at once, plus the null slot 0 that padding rows use).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.models.attention import AttentionMetadata
from pipeline.models.rope import StepRope


@dataclass(frozen=True, slots=True)
class PagedKVSpec:
    """A paged K/V cache of one attention layer: [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self, block_size: int) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * block_size * self.num_kv_heads * self.head_dim * element


@dataclass(frozen=True, slots=True)
class StateSlotSpec:
    """A per-sequence state of one recurrent layer: [num_slots, *per_slot] (a conv window, a delta-rule state)."""

    per_slot: tuple[int, ...]
    dtype: torch.dtype

    def bytes_per_slot(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        count = 1
        for n in self.per_slot:
            count *= n
        return count * element


CacheSpec = PagedKVSpec | StateSlotSpec


def allocate_caches(specs: list[CacheSpec], num_blocks: int, block_size: int,
                    device: torch.device | str | None = None, num_state_slots: int = 0) -> list[torch.Tensor]:
    """One tensor per spec: paged K/V by block, states by slot (``num_state_slots`` includes the null slot)."""
    return [torch.zeros(spec.shape(num_blocks, block_size), dtype=spec.dtype, device=device)
            if isinstance(spec, PagedKVSpec) else
            torch.zeros((num_state_slots, *spec.per_slot), dtype=spec.dtype, device=device) for spec in specs]


def bytes_per_block(specs: list[CacheSpec], block_size: int) -> int:
    """Device bytes one KV block costs across every cache (what the pool's size is divided by)."""
    return sum(spec.bytes_per_block(block_size) for spec in specs if isinstance(spec, PagedKVSpec))


def bytes_per_state_slot(specs: list[CacheSpec]) -> int:
    """Device bytes one sequence's recurrent state costs across every layer (0 for attention-only models)."""
    return sum(spec.bytes_per_slot() for spec in specs if isinstance(spec, StateSlotSpec))


@dataclass(slots=True)
class ForwardContext:
    """One forward's shared inputs. The model fills `rope` and `attention_plan` once per forward."""

    attention: AttentionMetadata
    caches: list[torch.Tensor]  # by cache index, as the model's cache_specs() declared them
    rope: StepRope | None = None  # the step's rope (pipeline/models/rope.py)
    attention_plan: object | None = None  # launch choices or reference gather indices, shared by all layers
    state_slots: torch.Tensor | None = None  # [B] int32: each row's state slot (recurrent layers; 0 = null slot)
    has_initial_state: torch.Tensor | None = None  # [B] bool: the row continues a state (its chunk starts past 0)
    # [T] int32: the state slot that keeps each token's recurrent state as it stands after it (-1: none), or None
    keep_slots: torch.Tensor | None = None

    def kv_cache(self, cache_index: int) -> torch.Tensor:
        return self.caches[cache_index]
