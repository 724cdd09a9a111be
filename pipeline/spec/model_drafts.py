"""What the model drafters share: a drafting sequence's part of their forwards, and the loop that drafts k tokens.

A model drafter keeps K/V of its own in the target's blocks (the decode stage allocated the drafts' slots before
asking), so each sequence's rows start where the drafter's cache of it ends: the first forward feeds every token the
drafter has not seen and picks the first draft after the last of them; each later forward feeds the draft just
picked, one row per sequence still short of its k. The picks are greedy: a draft is a guess, checked by the verify
rows, so how it was picked never changes the output. They stay on the device, each feeding the next forward; the
host reads them all once.

On a GPU the forwards replay CUDA graphs (``DecodeGraphs``, captured for the drafter) wherever a step's rows can be
made uniform: a row with fewer new tokens than the longest starts earlier, feeding again tokens the drafter has
seen (their K/V is written over with the same values). Eager Triton launches cost tens of microseconds of Python
each, which a drafter's small forwards would spend many times over.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.models.attention import build_attention_metadata
from pipeline.models.forward_context import ForwardContext
from pipeline.runner.cuda_graphs import DecodeGraphs
from pipeline.runner.step_plan import ForwardBatch
from pipeline.runner.token_feed import TokenFeed
from pipeline.spec.device_drafts import DeviceDrafts


@dataclass(slots=True)
class DraftRow:
    fed: list[int]  # the id the drafter takes at each position (p < len(fed)): a copy of the sequence's
    start: int  # the first position it has not seen; the first forward feeds start .. len(fed) - 1
    block_ids: list[int]  # the sequence's blocks (a copy: the host's list may grow meanwhile)
    k: int  # drafts wanted
    state: Any  # the drafter's record of this sequence (on Sequence.draft_history)


def uniform_width(rows: list[DraftRow]) -> int | None:
    """The drafts every row wants, when every row wants as many (they may then be promised: ``DeviceDrafts``)."""
    widths = {row.k for row in rows}
    return widths.pop() if len(widths) == 1 else None


MAX_REPLAYS = 8  # a drafter's first forward replays its graphs at most this many times (longer: one eager forward)

def drafter_record(seq: Any, kind: type) -> Any:
    """The drafter's record of ``seq`` (``Sequence.draft_history``), new when there is none of ``kind`` or the
    sequence was preempted since (its blocks, and the drafter's caches in them, are new)."""
    record = seq.draft_history
    if not isinstance(record, kind) or record.preemptions != seq.preemptions:
        record = seq.draft_history = kind(seq.preemptions)
    return record


# (input ids [T], positions [T], context, the carried hidden states [T, H] or None) -> hidden [T, H]
DraftForward = Callable[[torch.Tensor, torch.Tensor, ForwardContext, torch.Tensor | None], torch.Tensor]


@dataclass(slots=True)
class DraftGraphs:
    """A drafter's captured forwards: ``first`` for the first forward (rows of up to K + 1 tokens), ``step`` for the
    later ones (one token a row; may be ``first``). With ``carried``, the graphs' modules read the carried hidden
    states from ``carried`` and leave their output's in ``hidden_out`` (the MTP head)."""

    first: DecodeGraphs
    step: DecodeGraphs
    carried: torch.Tensor | None = None
    hidden_out: torch.Tensor | None = None
    _last: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def last_rows(self, rows: int, span: int, device: torch.device) -> torch.Tensor:
        """The index of each row's last position in a forward of ``rows`` rows of ``span`` positions (made once)."""
        index = self._last.get((rows, span))
        if index is None:
            index = self._last[(rows, span)] = torch.arange(span - 1, rows * span, span, device=device)
        return index


def draft_tokens(rows: list[DraftRow], forward: DraftForward, logits: Callable[[torch.Tensor], torch.Tensor],
                 caches: list[torch.Tensor], block_size: int, device: torch.device,
                 carry: Callable[[ForwardContext, torch.Tensor], torch.Tensor] | None = None,
                 graphs: DraftGraphs | None = None, into: DeviceDrafts | None = None) -> list[list[int]] | DeviceDrafts:
    """Run the drafter forwards for ``rows``; each row's drafts. ``carry(ctx, positions)``: what the first eager
    forward takes besides the tokens (the MTP head: the target's hidden states at the fed positions); later
    forwards take the drafter's own last hidden state instead. ``into``: promised drafts (every row drafts as many),
    filled on the device and returned (read after the verify step); nothing here waits for the device then."""
    picked: list[tuple[list[int], torch.Tensor]] = []  # (rows, their picks) per forward
    live = list(range(len(rows)))
    starts = [row.start for row in rows]
    ends = [len(row.fed) for row in rows]
    picks: torch.Tensor | None = None  # the previous forward's, for the rows in ``live`` order
    carried: torch.Tensor | None = None
    step = 0
    while live:
        q = max(ends[i] - starts[i] for i in live)
        graph = None if graphs is None else graphs.first if step == 0 else graphs.step
        width = max(len(rows[i].block_ids) for i in live)
        # a first forward longer than the graphs' rows runs as up to MAX_REPLAYS replays of their longest rows
        chunks = -(-q // graph.max_query_len) if graph is not None else 0
        q = max(q, chunks * graph.max_query_len) if chunks > 1 else q
        if (graph is not None and chunks <= MAX_REPLAYS and all(ends[i] >= q for i in live)
                and graph.fits(len(live), min(q, graph.max_query_len), width)):
            span = min(q, graph.max_query_len)
            last = graphs.last_rows(len(live), span, device)
            if carried is not None and graphs.carried is not None:
                graphs.carried[:len(live)].copy_(carried)
            feed = None if picks is None else TokenFeed(np.arange(len(live)), np.arange(len(live)), picks)
            for before in range(q - span, -1, -span):  # (each row's positions end - q .. end - 1, span at a time)
                batch = _uniform_batch([rows[i] for i in live], [ends[i] - before for i in live], span, width,
                                       block_size, first=step == 0)
                out = graph.run(batch, feed)
            step_logits = out if span == 1 else out.index_select(0, last)  # (one row a sequence: each its last)
            hidden = graphs.hidden_out if span > 1 or graphs.hidden_out is None else graphs.hidden_out[:len(live)]
        else:
            query_lens = [ends[i] - starts[i] for i in live]
            meta = build_attention_metadata(query_lens, [ends[i] for i in live], [rows[i].block_ids for i in live],
                                            block_size, device)
            positions = torch.tensor([p for i in live for p in range(starts[i], ends[i])], dtype=torch.int64,
                                     device=device)
            ids = picks if picks is not None else torch.tensor(
                [t for i in live for t in rows[i].fed[starts[i]:]], dtype=torch.int64, device=device)
            ctx = ForwardContext(meta, caches)
            if carry is not None and carried is None:
                carried = carry(ctx, positions)
            hidden = forward(ids, positions, ctx, carried)
            last = torch.tensor(meta.query_start_loc_host[1:], dtype=torch.int64, device=device) - 1
            step_logits = logits(hidden.index_select(0, last))
        picks = step_logits.argmax(dim=-1)
        picked.append((live, picks))
        step += 1
        following = [j for j, i in enumerate(live) if rows[i].k > step]
        if following and len(following) < len(live):  # (a host list made a device tensor: the host waits)
            keep = torch.tensor(following, dtype=torch.int64, device=device)
            last, picks = last.index_select(0, keep), picks.index_select(0, keep)
        if following and carry is not None:
            # as many hidden rows as rows going on: one position each and none dropped, each its own last
            carried = hidden if hidden.shape[0] == len(following) else hidden.index_select(0, last)
        for i in live:
            starts[i], ends[i] = ends[i], ends[i] + 1
        live = [live[j] for j in following]
    if into is not None:
        if not picked or any(len(step_rows) != len(rows) for step_rows, _ in picked):
            raise ValueError("promised drafts need as many drafts from every row")
        into.fill(torch.stack([p for _, p in picked], dim=1))
        return into
    drafts: list[list[int]] = [[] for _ in rows]
    values = torch.cat([p for _, p in picked]).tolist() if picked else []
    at = 0
    for step_rows, _ in picked:
        for i in step_rows:
            drafts[i].append(values[at])
            at += 1
    return drafts


def _uniform_batch(rows: list[DraftRow], ends: list[int], q: int, width: int, block_size: int,
                   first: bool) -> ForwardBatch:
    """Rows of the q positions before each end (the first forward: their ids; later ones: fed from the picks)."""
    n = len(rows)
    positions = (np.asarray(ends, dtype=np.int64)[:, None] - q + np.arange(q, dtype=np.int64)[None, :]).reshape(-1)
    tables = np.zeros((n, width), dtype=np.int32)
    for b, row in enumerate(rows):
        tables[b, :len(row.block_ids)] = row.block_ids
    row_of = np.repeat(np.arange(n), q)
    slots = tables[row_of, positions // block_size].astype(np.int64) * block_size + positions % block_size
    ids = (np.asarray([t for row, end in zip(rows, ends) for t in row.fed[end - q:end]], dtype=np.int64) if first
           else np.zeros(n * q, dtype=np.int64))
    empty = np.zeros(0, dtype=np.int64)
    return ForwardBatch(ids, positions, slots, np.arange(0, (n + 1) * q, q, dtype=np.int32),
                        np.asarray(ends, dtype=np.int32), tables, empty, empty, empty, np.zeros(n, dtype=np.int32))
