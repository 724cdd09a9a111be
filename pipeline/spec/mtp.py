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
from pipeline.spec.model_drafts import DraftRow, draft_tokens


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

    def plan(self, wanted: list[tuple[Sequence, int]]) -> list[DraftRow]:
        rows = []
        for seq, k in wanted:
            state = seq.draft_history
            if not isinstance(state, MtpState) or state.preemptions != seq.preemptions:
                state = seq.draft_history = MtpState(seq.preemptions)
            tokens = seq.token_ids
            start = min(state.seen, len(tokens) - 2)
            state.seen = len(tokens) - 1
            rows.append(DraftRow(tokens[start + 1:], start, list(seq.block_ids), k, state))
        return rows

    @torch.inference_mode()
    def draft(self, rows: list[DraftRow]) -> list[list[int]]:
        model, caches = self.model, self.runner.caches
        hidden_cache = caches[self.hidden_index]

        def target_hidden(ctx: ForwardContext, positions: torch.Tensor) -> torch.Tensor:
            return read_hidden(hidden_cache, ctx.attention.slot_mapping)

        return draft_tokens(rows, lambda ids, positions, ctx, hidden: model.mtp_forward(ids, positions, hidden, ctx),
                            model.compute_logits, [caches[self.hidden_index - 1]], self.block_size,
                            self.runner.device, carry=target_hidden)
