"""Feeding a step the tokens its previous step sampled, without bringing them to the host.

One step ahead: the decode stage launches step N+1 before it has read step N's tokens. The forward
batch names, for each such token, its input index (`feed_targets`) and the row of step N that
sampled it (`feed_sources`); the runner copies those tokens from step N's device tensor into step
N+1's input ids, on the stream, after step N's sampler and before step N+1's forward. A row of step
N+1 may carry more tokens than the fed one (drafts after it); only the fed ones are copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(slots=True)
class TokenFeed:
    """Input indices `targets` take the previous step's tokens at rows `sources`."""

    targets: np.ndarray  # int64 [F]
    sources: np.ndarray  # int64 [F]
    tokens: Tensor  # int64 [rows of the previous step], on the device

    @classmethod
    def of(cls, targets: np.ndarray, sources: np.ndarray, tokens: Tensor | None) -> TokenFeed | None:
        if not len(targets):
            return None
        if tokens is None:
            raise ValueError("a row names a previous step's token, but no previous step's tokens are known")
        if int(sources.max()) >= tokens.shape[0]:
            raise ValueError(f"a row names row {int(sources.max())} of a previous step of {tokens.shape[0]} rows")
        return cls(targets, sources, tokens)

    def apply(self, input_ids: Tensor) -> None:
        """Write the fed tokens into `input_ids` (a device tensor) in place, without a host sync."""
        n = len(self.targets)
        steady = np.arange(n)
        if (self.targets == steady).all() and (self.sources == steady).all():
            input_ids[:n].copy_(self.tokens[:n], non_blocking=True)  # the steady state: same batch, same order
            return
        grid = _grid(self.targets, self.sources)
        if grid is not None and input_ids.stride(0) == 1 and self.tokens.stride(0) == 1:
            # rows of consecutive indices on both sides (verify rows fed their drafts): one strided copy
            rows, width, t0, t_step, s0, s_step = grid
            into = input_ids.as_strided((rows, width), (t_step, 1), input_ids.storage_offset() + t0)
            into.copy_(self.tokens.as_strided((rows, width), (s_step, 1), self.tokens.storage_offset() + s0))
            return
        indices = torch.from_numpy(np.stack([self.targets, self.sources]))
        if input_ids.is_cuda:
            indices = indices.pin_memory().to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, indices[0], self.tokens.index_select(0, indices[1]))


def _grid(targets: np.ndarray, sources: np.ndarray) -> tuple[int, int, int, int, int, int] | None:
    """(rows, width, first target, target row step, first source, source row step) when the feed is rows of ``width``
    consecutive indices on both sides, each side's rows a constant step apart (not overlapping); else None."""
    n = len(targets)
    breaks = np.flatnonzero(np.diff(targets) != 1)
    width = int(breaks[0]) + 1 if len(breaks) else n
    if n % width:
        return None
    rows = n // width
    t, s = targets.reshape(rows, width), sources.reshape(rows, width)
    offsets = np.arange(width)
    if not ((t == t[:, :1] + offsets).all() and (s == s[:, :1] + offsets).all()):
        return None
    t_step = int(t[1, 0] - t[0, 0]) if rows > 1 else width
    s_step = int(s[1, 0] - s[0, 0]) if rows > 1 else width
    if t_step < width or s_step < 1 or (rows > 1 and not ((np.diff(t[:, 0]) == t_step).all()
                                                          and (np.diff(s[:, 0]) == s_step).all())):
        return None
    return rows, width, int(t[0, 0]), t_step, int(s[0, 0]), s_step
