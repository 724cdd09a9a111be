"""The MTP drafter: the checkpoint's multi-token-prediction head (pipeline/models/mtp.py) drafts k tokens, the
first from the target's hidden states, each later one from the head's own.

Its first forward feeds the head every position it has not seen with the target's hidden state there: at length L
the target has computed positions up to L - 2 (the last token is still to be fed), so the head runs at positions
p = c .. L - 2 on (token p + 1, hidden p) and picks token L. The later forwards run at L - 1, L, .. on (the draft
just picked, the head's last hidden state). Only the first forward's positions are kept as seen: the later ones used
the head's guesses for the hidden states and are fed again, with the target's, next time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline.models.forward_context import ForwardContext
from pipeline.models.mtp import read_hidden
from pipeline.sequence import Sequence
from pipeline.runner.cuda_graphs import DecodeGraphs
from pipeline.spec.device_drafts import DeviceDrafts
from pipeline.spec.model_drafts import DraftGraphs, DraftRow, draft_tokens, drafter_record, uniform_width


@dataclass(slots=True)
class MtpState:
    preemptions: int  # the sequence's count when this record began (its blocks are new after a preemption)
    seen: int = 0  # positions below this the head has run at with the target's hidden states


class MtpDrafter:
    name = "mtp"
    on_device = True
    accepts_all = False

    def __init__(self, model: nn.Module, runner, block_size: int) -> None:
        assert model.mtp is not None and model.hidden_cache_index is not None
        self.model = model
        self.runner = runner  # the target's (its caches are allocated after this is built)
        self.hidden_index = model.hidden_cache_index  # the hidden-state cache, right after the head's K/V
        self.block_size = block_size
        self.graphs: DraftGraphs | None = None

    def plan(self, wanted: list[tuple[Sequence, int]]) -> list[DraftRow]:
        rows = []
        for seq, k in wanted:
            state = drafter_record(seq, MtpState)
            tokens = seq.token_ids
            start = min(state.seen, len(tokens) - 2)
            state.seen = len(tokens) - 1
            rows.append(DraftRow(tokens[1:], start, list(seq.block_ids), k, state))  # at p: token p + 1
        return rows

    def capture_graphs(self, max_batch: int, max_model_len: int, max_query_len: int) -> None:
        """CUDA graphs of the head (after the caches are allocated): the first forward, rows of up to K + 1
        positions reading the target's hidden states; the later ones, one position a row reading the head's."""
        caches, model = self.runner.caches, self.model
        size = model.arch.hidden_size
        device, dtype = self.runner.device, model.model.embed_tokens.weight.dtype
        carried = torch.zeros(max_batch, size, dtype=dtype, device=device)
        hidden_out = torch.zeros(max_batch * max_query_len, size, dtype=dtype, device=device)
        shape = dict(max_batch=max_batch, max_blocks_per_seq=-(-max_model_len // self.block_size),
                     max_model_len=max_model_len, num_kv_heads=model.arch.num_kv_heads, device=device)
        kv = [caches[self.hidden_index - 1]]
        first = DecodeGraphs(_HeadInput(model, caches[self.hidden_index], carried, hidden_out), kv,
                             max_query_len=max_query_len, **shape)
        step = DecodeGraphs(_HeadInput(model, None, carried, hidden_out), kv, **shape)
        self.graphs = DraftGraphs(first, step, carried, hidden_out)

    def uniform_width(self, rows: list[DraftRow]) -> int | None:
        return uniform_width(rows)

    @torch.inference_mode()
    def draft(self, rows: list[DraftRow], into: DeviceDrafts | None = None) -> list[list[int]] | DeviceDrafts:
        model, caches = self.model, self.runner.caches
        hidden_cache = caches[self.hidden_index]

        def target_hidden(ctx: ForwardContext, positions: torch.Tensor) -> torch.Tensor:
            return read_hidden(hidden_cache, ctx.attention.slot_mapping)

        return draft_tokens(rows, lambda ids, positions, ctx, hidden: model.mtp_forward(ids, positions, hidden, ctx),
                            model.compute_logits, [caches[self.hidden_index - 1]], self.block_size,
                            self.runner.device, carry=target_hidden, graphs=self.graphs, into=into)


class _HeadInput:
    """The head as a graph replays it: its hidden input read in the graph (the target's from the hidden-state cache
    by slot, or the carried buffer), its output's hidden states left in ``hidden_out``."""

    def __init__(self, model: nn.Module, hidden_cache: torch.Tensor | None, carried: torch.Tensor,
                 hidden_out: torch.Tensor) -> None:
        self.model, self.hidden_cache, self.carried, self.hidden_out = model, hidden_cache, carried, hidden_out

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = (read_hidden(self.hidden_cache, ctx.attention.slot_mapping) if self.hidden_cache is not None
                  else self.carried[:ids.shape[0]])
        out = self.model.mtp_forward(ids, positions, hidden, ctx)
        self.hidden_out[:out.shape[0]].copy_(out)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
