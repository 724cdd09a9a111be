"""What the model drafters share: a drafting sequence's part of their forwards, and the loop that drafts k tokens.

A model drafter keeps K/V of its own in the target's blocks (the decode stage allocated the drafts' slots before
asking), so each sequence's rows start where the drafter's cache of it ends: the first forward feeds every token the
drafter has not seen and picks the first draft after the last of them; each later forward feeds the draft just
picked, one row per sequence still short of its k. The picks are greedy: a draft is a guess, checked by the verify
rows, so how it was picked never changes the output.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.models.attention import build_attention_metadata
from pipeline.models.forward_context import ForwardContext


@dataclass(slots=True)
class DraftRow:
    tokens: list[int]  # fed at positions start .. start + len(tokens) - 1 by the first forward
    start: int
    block_ids: list[int]  # the sequence's blocks (a copy: the host's list may grow meanwhile)
    k: int  # drafts wanted
    state: Any  # the drafter's record of this sequence (on Sequence.draft_history)


# (input ids [T], positions [T], context, each row's carried state or None) -> (hidden [T, H] at every token)
DraftForward = Callable[[torch.Tensor, torch.Tensor, ForwardContext, torch.Tensor | None], torch.Tensor]


def draft_tokens(rows: list[DraftRow], forward: DraftForward, logits: Callable[[torch.Tensor], torch.Tensor],
                 caches: list[torch.Tensor], block_size: int, device: torch.device,
                 carry: Callable[[ForwardContext, torch.Tensor], torch.Tensor] | None = None) -> list[list[int]]:
    """Run the drafter forwards for ``rows``; each row's drafts. ``carry(ctx, hidden)``: what the first forward
    takes besides the tokens (the MTP head: the target's hidden states at the fed positions); later forwards take
    the drafter's own last hidden state instead."""
    drafts: list[list[int]] = [[] for _ in rows]
    feeds = [(row.tokens, row.start) for row in rows]
    live = list(range(len(rows)))
    carried: torch.Tensor | None = None
    while live:
        query_lens = [len(feeds[i][0]) for i in live]
        ends = [feeds[i][1] + len(feeds[i][0]) for i in live]
        meta = build_attention_metadata(query_lens, ends, [rows[i].block_ids for i in live], block_size, device)
        ids = torch.tensor([t for i in live for t in feeds[i][0]], dtype=torch.int64, device=device)
        positions = torch.tensor([p for i, end in zip(live, ends) for p in range(feeds[i][1], end)],
                                 dtype=torch.int64, device=device)
        ctx = ForwardContext(meta, caches)
        if carried is None and carry is not None:
            carried = carry(ctx, positions)
        hidden = forward(ids, positions, ctx, carried)
        last = torch.tensor(meta.query_start_loc_host[1:], dtype=torch.int64, device=device) - 1
        picks = logits(hidden.index_select(0, last)).argmax(dim=-1).tolist()
        following: list[int] = []
        for j, (i, token) in enumerate(zip(live, picks)):
            drafts[i].append(token)
            if len(drafts[i]) < rows[i].k:
                feeds[i] = ([token], ends[j])
                following.append(j)
        live = [live[j] for j in following]
        if following and carry is not None:
            carried = hidden.index_select(0, last[torch.tensor(following, device=device)])
    return drafts
