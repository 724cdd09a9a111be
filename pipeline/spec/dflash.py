"""The DFlash drafter: one forward of the block-diffusion model (pipeline/models/dflash.py) drafts all k tokens of
every drafting sequence.

A sequence of length L has its last token still to be fed, so the target has computed positions 0 .. L - 2 and
the drafter's caches hold their context K/V. Its block sits at positions L - 1 .. L - 1 + k: the last token, then
k mask tokens; the draft at position L - 1 + j (j >= 1) is the pick from that position's logits. Each block
position is a row of one query whose context reaches the end of the block, which is what the attention's causal
rule already gives a row's last token: every block query sees every context and block key, as DFlash wants,
through the same paged kernels (and CUDA graphs) as a decode step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipeline.models.dflash import DFlashDraftModel
from pipeline.models.forward_context import ForwardContext
from pipeline.runner.cuda_graphs import DecodeGraphs
from pipeline.runner.model_runner import forward_metadata
from pipeline.runner.step_plan import ForwardBatch
from pipeline.sequence import Sequence
from pipeline.spec.device_drafts import DeviceDrafts


@dataclass(slots=True)
class DFlashPlan:
    batch: ForwardBatch  # one row per block position
    draft_rows: list[np.ndarray]  # per sequence: the rows whose picks are its drafts, in order


class DFlashDrafter:
    name = "dflash"
    on_device = True
    accepts_all = False

    def __init__(self, draft: DFlashDraftModel, target: nn.Module, runner, first_cache: int, block_size: int) -> None:
        self.block = _BlockForward(draft, target)
        self.runner = runner  # the target's (its caches are allocated after this is built)
        self.caches = slice(first_cache, first_cache + draft.arch.num_layers)
        self.mask = draft.config.mask_token_id
        self.max_drafts = draft.config.block_size - 1
        self.block_size = block_size  # the KV cache's
        self.graphs: DecodeGraphs | None = None

    def plan(self, wanted: list[tuple[Sequence, int]]) -> DFlashPlan:
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        draft_rows = []
        for seq, k in wanted:
            k = min(k, self.max_drafts)
            last = len(seq.token_ids) - 1
            first_row = len(ids)
            ids += [seq.token_ids[last]] + [self.mask] * k
            positions += range(last, last + k + 1)
            seq_lens += [last + k + 1] * (k + 1)
            tables += [seq.block_ids] * (k + 1)
            draft_rows.append(np.arange(first_row + 1, first_row + k + 1))
        width = max(len(t) for t in tables)
        table = np.zeros((len(tables), width), dtype=np.int32)
        for row, blocks in enumerate(tables):
            table[row, :len(blocks)] = blocks
        pos = np.asarray(positions, dtype=np.int64)
        slots = table[np.arange(len(pos)), pos // self.block_size].astype(np.int64) * self.block_size
        slots += pos % self.block_size
        n = len(pos)
        empty = np.zeros(0, dtype=np.int64)
        batch = ForwardBatch(np.asarray(ids, dtype=np.int64), pos, slots, np.arange(n + 1, dtype=np.int32),
                             np.asarray(seq_lens, dtype=np.int32), table, empty, empty, empty,
                             np.zeros(n, dtype=np.int32))
        return DFlashPlan(batch, draft_rows)

    def capture_graphs(self, max_batch: int, max_model_len: int, max_query_len: int) -> None:
        """CUDA graphs of the block forward (after the caches are allocated): ``max_batch`` sequences of up to
        ``max_query_len`` block positions, one row each."""
        runner = self.runner
        self.graphs = DecodeGraphs(self.block, runner.caches[self.caches], max_batch=max_batch * max_query_len,
                                   max_blocks_per_seq=-(-max_model_len // self.block_size),
                                   max_model_len=max_model_len, num_kv_heads=self.block.draft.arch.num_kv_heads,
                                   device=runner.device)

    def uniform_width(self, plan: DFlashPlan) -> int | None:
        widths = {len(rows) for rows in plan.draft_rows}
        return widths.pop() if len(widths) == 1 else None

    @torch.inference_mode()
    def draft(self, plan: DFlashPlan, into: DeviceDrafts | None = None) -> list[list[int]] | DeviceDrafts:
        batch = plan.batch
        graphs = self.graphs
        if graphs is not None and graphs.fits(batch.num_seqs, 1, batch.block_tables.shape[1]):
            logits = graphs.run(batch, None)[:batch.num_seqs]
        else:
            device = self.runner.device
            ctx = ForwardContext(forward_metadata(batch, lambda array: torch.from_numpy(array).to(device)),
                                 self.runner.caches[self.caches])
            hidden = self.block(torch.from_numpy(batch.input_ids).to(device),
                                torch.from_numpy(batch.positions).to(device), ctx)
            logits = self.block.compute_logits(hidden)
        picks = logits.argmax(dim=-1)
        if into is not None:  # (as many for every sequence) row i's block: its last token, then its k drafts
            into.fill(picks.view(len(plan.draft_rows), -1)[:, 1:])
            return into
        picks = picks.tolist()
        return [[picks[i] for i in rows] for rows in plan.draft_rows]


class _BlockForward:
    """The block forward as a module the graphs replay: the target's embedding, the draft layers, the target's
    lm_head."""

    def __init__(self, draft: DFlashDraftModel, target: nn.Module) -> None:
        self.draft, self.target = draft, target

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.draft(self.target.model.embed_tokens(ids), positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)
