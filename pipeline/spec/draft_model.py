"""The draft-model drafter: a smaller model with the target's tokenizer drafts k tokens greedily, one forward per
draft after a first one that feeds what it has not seen of the sequence (pipeline/spec/model_drafts.py).

Its K/V caches follow the target's in the runner's cache list and use the target's block ids, so the pool sizes
both at once and the tiers, prefix caching and preemption move both. Which of its positions hold the sequence's
own tokens is tracked per sequence: after drafting at length L it holds every position below L and its drafts at
L, L+1, .., of which those the verify accepted are the sequence's tokens too. A preempted sequence starts over.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pipeline.sequence import Sequence
from pipeline.runner.cuda_graphs import DecodeGraphs
from pipeline.spec.device_drafts import DeviceDrafts
from pipeline.spec.model_drafts import DraftGraphs, DraftRow, draft_tokens, drafter_record, uniform_width


@dataclass(slots=True)
class DraftModelState:
    preemptions: int  # the sequence's count when this record began (its blocks are new after a preemption)
    base: int = 0  # the sequence's length when it last drafted: every position below holds its tokens
    fed: list[int] = field(default_factory=list)  # the drafts then fed at base, base + 1, ...
    fed_on_device: tuple[DeviceDrafts, int] | None = None  # or: they are these drafts' row, but the last

    def computed(self, tokens: list[int]) -> int:
        """Positions from 0 whose K/V in the drafter's cache are of ``tokens`` (at least one token is left to feed)."""
        if self.fed_on_device is not None:  # (read by now: the verify step that checked them was read)
            drafts, row = self.fed_on_device
            self.fed, self.fed_on_device = drafts.values()[row][:-1], None
        n = self.base
        for draft in self.fed:
            if n >= len(tokens) or tokens[n] != draft:
                break
            n += 1
        return min(n, len(tokens) - 1)


class DraftModelDrafter:
    name = "draft"
    on_device = True
    accepts_all = False

    def __init__(self, model: nn.Module, runner, first_cache: int, block_size: int) -> None:
        self.model = model
        self.runner = runner  # the target's (its caches are allocated after this is built)
        self.caches = slice(first_cache, first_cache + len(model.cache_specs(torch.float32)))
        self.block_size = block_size
        self.graphs: DraftGraphs | None = None

    def plan(self, wanted: list[tuple[Sequence, int]]) -> list[DraftRow]:
        rows = []
        for seq, k in wanted:
            state = drafter_record(seq, DraftModelState)
            tokens = seq.token_ids
            start = state.computed(tokens)
            state.base, state.fed, state.fed_on_device = len(tokens), [], None
            rows.append(DraftRow(list(tokens), start, list(seq.block_ids), k, state))
        return rows

    def capture_graphs(self, max_batch: int, max_model_len: int, max_query_len: int) -> None:
        """CUDA graphs of its forwards (after the caches are allocated): rows of up to K + 1 tokens."""
        graphs = DecodeGraphs(self.model, self.runner.caches[self.caches], max_batch=max_batch,
                              max_blocks_per_seq=-(-max_model_len // self.block_size), max_model_len=max_model_len,
                              num_kv_heads=self.model.arch.num_kv_heads, device=self.runner.device,
                              max_query_len=max_query_len)
        self.graphs = DraftGraphs(graphs, graphs)

    def uniform_width(self, rows: list[DraftRow]) -> int | None:
        return uniform_width(rows)

    @torch.inference_mode()
    def draft(self, rows: list[DraftRow], into: DeviceDrafts | None = None) -> list[list[int]] | DeviceDrafts:
        model = self.model
        drafts = draft_tokens(rows, lambda ids, positions, ctx, _: model(ids, positions, ctx), model.compute_logits,
                              self.runner.caches[self.caches], self.block_size, self.runner.device,
                              graphs=self.graphs, into=into)
        if isinstance(drafts, DeviceDrafts):
            for i, row in enumerate(rows):
                row.state.fed_on_device = (drafts, i)
            return drafts
        for row, out in zip(rows, drafts):
            row.state.fed = out[:-1]  # the last draft was picked, never fed
        return drafts
