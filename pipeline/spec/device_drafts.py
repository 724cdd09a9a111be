"""Drafts a model drafter leaves on the device, so the verify step that checks them can be launched before the host
has read them.

A model drafter's picks are device tensors. Reading them costs a wait for the drafter's forwards, and the verify
step could not be planned and launched until then: the device sat idle through the host's read, its planning and
its launch. Left on the device, the picks feed the verify rows there (``ScheduledChunk.fed_drafts``, the way one
step ahead feeds a step's tokens to the next), and the host reads them after the verify step, from a copy queued
right behind the drafter's forwards. Only rows whose sampling does not depend on the drafts' values can be fed so:
penalties count the drafts before each position, a grammar's mask follows them, a thinking budget may force a token
after them; those steps read the drafts first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class DeviceDrafts:
    """[n, k] draft ids on the device, row i the i-th drafting sequence's k drafts, and their host copy."""

    tokens: torch.Tensor  # int64 [n, k] on the device (contiguous)
    host: torch.Tensor  # int64 [n, k]: pinned, filled by a copy queued after the drafts (the same tensor on CPU)
    copied: torch.cuda.Event | None  # recorded after that copy (None on CPU)
    # the ids in row order, one view for every row a step feeds (row i's j-th draft at i * width + j)
    flat: torch.Tensor = field(init=False)
    _values: list[list[int]] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.flat = self.tokens.view(-1)

    @classmethod
    def of(cls, tokens: torch.Tensor) -> DeviceDrafts:
        """Queue the host copy of ``tokens`` (int64 [n, k]) and return at once."""
        tokens = tokens.contiguous()
        if not tokens.is_cuda:
            return cls(tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(tokens, host, copied)

    @property
    def width(self) -> int:
        """Drafts per sequence."""
        return int(self.tokens.shape[1])

    def values(self) -> list[list[int]]:
        """Each sequence's drafts on the host (waits for the copy, long done once the verify step is read)."""
        if self._values is None:
            if self.copied is not None:
                self.copied.synchronize()
            self._values = self.host.tolist()
        return self._values
