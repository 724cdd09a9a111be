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
        indices = torch.from_numpy(np.stack([self.targets, self.sources]))
        if input_ids.is_cuda:
            indices = indices.pin_memory().to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, indices[0], self.tokens.index_select(0, indices[1]))
