"""Expert parallelism: which experts a rank holds, and the one collective the model issues for them.

Every rank runs the same forward with the dense parts replicated; a mixture-of-experts block holds a contiguous
share of the routed experts (``ExpertShard``) and sums its partial output with the other ranks' (``ExpertGroup``,
an all-reduce over torch.distributed: NCCL on GPUs, gloo on CPUs). One rank holds every expert and never calls a
collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class ExpertShard:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"expert-parallel rank {self.rank} is not in [0, {self.size})")

    def experts(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of this rank's routed experts: contiguous, the first ``num_experts % size`` ranks hold
        one more."""
        if self.size > num_experts:
            raise ValueError(f"{num_experts} experts cannot be split over {self.size} ranks")
        base, extra = divmod(num_experts, self.size)
        return self.rank * base + min(self.rank, extra), base + (self.rank < extra)


class ExpertGroup:
    """The ranks that share a model's experts: ``all_reduce`` sums a tensor over them in place (the MoE blocks'
    partial outputs, in the same order on every rank: one call per block per forward)."""

    def __init__(self, shard: ExpertShard, group: Any = None) -> None:
        self.shard = shard
        self.group = group  # a torch.distributed process group (None: the default one)
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self.calls += 1
        dist.all_reduce(tensor, group=self.group)
        return tensor
