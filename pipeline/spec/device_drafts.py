"""Drafts a model drafter leaves on the device, so the verify step that checks them can be launched before the host
has read them, and planned before they are even drafted.

A model drafter's picks are device tensors. Reading them costs a wait for the drafter's forwards, and the verify
step could not be planned and launched until then: the device sat idle through the host's read, its planning and
its launch. Left on the device, the picks feed the verify rows there (``ScheduledChunk.fed_drafts``, the way one
step ahead feeds a step's tokens to the next), and the host reads them after the verify step, from a copy queued
right behind the drafter's forwards. Only rows whose sampling does not depend on the drafts' values can be fed so:
penalties count the drafts before each position, a grammar's mask follows them, a thinking budget may force a token
after them; those steps read the drafts first.

Drafts may also be promised (``pending``): the verify stage queues the drafter's forwards on the device thread and
hands decode the promise at once, so decode plans its verify step while the drafter runs. The device thread runs
its jobs in order, so the step that feeds the drafts is launched after the forwards that fill them; the runner takes
the device ids from ``ids()``, which raises the drafter's error if it failed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.runner.host_staging import queue_host_copy


@dataclass(slots=True)
class DeviceDrafts:
    """[n, width] draft ids on the device, row i the i-th drafting sequence's drafts, and their host copy."""

    width: int  # drafts per sequence
    tokens: torch.Tensor | None = None  # int64 [n, width] on the device (contiguous); None until filled
    host: torch.Tensor | None = None  # int64 [n, width]: pinned, filled by a copy queued after the drafts
    copied: torch.cuda.Event | None = None  # recorded after that copy (None on CPU)
    # the ids in row order, one view for every row a step feeds (row i's j-th draft at i * width + j)
    flat: torch.Tensor | None = field(default=None, init=False)
    error: BaseException | None = field(default=None, init=False)  # the drafter's, when filling failed
    _values: list[list[int]] | None = field(default=None, init=False)

    @classmethod
    def pending(cls, width: int) -> DeviceDrafts:
        """Drafts still to be made (``fill`` or ``fail``, on the device thread)."""
        return cls(width)

    @classmethod
    def of(cls, tokens: torch.Tensor) -> DeviceDrafts:
        """Drafts made: queue the host copy of ``tokens`` (int64 [n, k]) and return at once."""
        drafts = cls(int(tokens.shape[1]))
        drafts.fill(tokens)
        return drafts

    def fill(self, tokens: torch.Tensor) -> None:
        """Take the drafter's picks (int64 [n, width]) and queue their host copy behind them; no wait."""
        if tokens.dim() != 2 or tokens.shape[1] != self.width:
            raise ValueError(f"drafts of shape {tuple(tokens.shape)} for a width of {self.width}")
        tokens = tokens.contiguous()
        self.host, self.copied = queue_host_copy(tokens)
        self.tokens, self.flat = tokens, tokens.view(-1)

    def fail(self, error: BaseException) -> None:
        self.error = error

    def ids(self) -> torch.Tensor:
        """The flat device ids the verify rows are fed from; raises what kept them from being drafted."""
        if self.error is not None:
            raise RuntimeError("the drafter failed on the drafts this step verifies") from self.error
        if self.flat is None:
            raise RuntimeError("a step feeds drafts that were never drafted (their forwards run before it)")
        return self.flat

    def values(self) -> list[list[int]]:
        """Each sequence's drafts on the host (waits for the copy, long done once the verify step is read)."""
        if self._values is None:
            self.ids()
            if self.copied is not None:
                self.copied.synchronize()
            assert self.host is not None
            self._values = self.host.tolist()
        return self._values
