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
    """Run the drafter forwards for ``rows``; each row's drafts. ``carry(ctx, positions)``: what the first forward
    takes besides the tokens (the MTP head: the target's hidden states at the fed positions); later forwards take
    the drafter's own last hidden state instead. Each forward's picks stay on the device and feed the next; the host
    reads them all once, at the end."""
    picked: list[tuple[list[int], torch.Tensor]] = []  # (rows, their picks) per forward
    live = list(range(len(rows)))
    starts = [row.start for row in rows]
    lengths = [len(row.tokens) for row in rows]
    ids = torch.tensor([t for row in rows for t in row.tokens], dtype=torch.int64, device=device)
    carried: torch.Tensor | None = None
    step = 0
    while live:
        ends = [starts[i] + lengths[i] for i in live]
        meta = build_attention_metadata([lengths[i] for i in live], ends, [rows[i].block_ids for i in live],
                                        block_size, device)
        positions = torch.tensor([p for i, end in zip(live, ends) for p in range(starts[i], end)], dtype=torch.int64,
                                 device=device)
        ctx = ForwardContext(meta, caches)
        if carried is None and carry is not None:
            carried = carry(ctx, positions)
        hidden = forward(ids, positions, ctx, carried)
        last = torch.tensor(meta.query_start_loc_host[1:], dtype=torch.int64, device=device) - 1
        picks = logits(hidden.index_select(0, last)).argmax(dim=-1)
        picked.append((live, picks))
        step += 1
        following = [j for j, i in enumerate(live) if rows[i].k > step]
        if len(following) < len(live):
            keep = torch.tensor(following, dtype=torch.int64, device=device)
            picks, last = picks.index_select(0, keep), last.index_select(0, keep)
        for j, i in enumerate(live):
            starts[i], lengths[i] = ends[j], 1
        live = [live[j] for j in following]
        ids = picks
        if carry is not None:
            carried = hidden.index_select(0, last)
    drafts: list[list[int]] = [[] for _ in rows]
    values = torch.cat([p for _, p in picked]).tolist() if picked else []
    at = 0
    for step_rows, _ in picked:
        for i in step_rows:
            drafts[i].append(values[at])
            at += 1
    return drafts
