"""Feeding a step the tokens its previous step sampled, without bringing them to the host.

One step ahead: the decode stage launches step N+1 before it has read step N's tokens. Each such
decode chunk names the row of step N that sampled its token (`ScheduledChunk.previous_row`); the
runner copies those tokens from step N's device tensor into step N+1's input ids, on the stream,
after step N's sampler and before step N+1's forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pipeline.runner.step_plan import ScheduledChunk


@dataclass(slots=True)
class TokenFeed:
    """Input positions `targets` take the previous step's tokens at rows `sources`."""

    targets: list[int]
    sources: list[int]
    tokens: Tensor  # int64 [rows of the previous step], on the device

    @classmethod
    def for_chunks(cls, chunks: list[ScheduledChunk], query_start: np.ndarray, tokens: Tensor | None) -> TokenFeed | None:
        targets: list[int] = []
        sources: list[int] = []
        for i, chunk in enumerate(chunks):
            if chunk.previous_row >= 0:
                if len(chunk.token_ids) != 1:
                    raise ValueError("a chunk fed from the previous step carries exactly one token")
                targets.append(int(query_start[i]))
                sources.append(chunk.previous_row)
        if not targets:
            return None
        if tokens is None:
            raise ValueError("a chunk names a previous step's token, but no previous step's tokens are known")
        if max(sources) >= tokens.shape[0]:
            raise ValueError(f"a chunk names row {max(sources)} of a previous step of {tokens.shape[0]} rows")
        return cls(targets, sources, tokens)

    def apply(self, input_ids: Tensor) -> None:
        """Write the fed tokens into `input_ids` (a device tensor) in place, without a host sync."""
        n = len(self.targets)
        if self.targets == list(range(n)) and self.sources == list(range(n)):
            input_ids[:n].copy_(self.tokens[:n], non_blocking=True)  # the steady state: same batch, same order
            return
        indices = torch.tensor([self.targets, self.sources], dtype=torch.int64,
                               pin_memory=input_ids.is_cuda).to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, indices[0], self.tokens.index_select(0, indices[1]))
