"""CUDA graphs for uniform decode steps: one replay instead of hundreds of kernel launches per step.

A step is uniform when each of its B rows carries the same number q of tokens and wants logits at
every one of them: plain decode (q = 1) or a speculative verify of K drafts (q = K+1). A graph is
captured per (padded batch size, q), batch sizes 1, 2, 4, 8, then multiples of 8 up to max_batch,
q from 1 to max_query_len, over static device buffers. A step copies its inputs from pinned host
buffers into them (one non-blocking copy each; tokens still on the device from the previous step
are copied in on the device), pads the unused rows (slot -1: the KV write skips it; a context of q
keys over the null block; the null state slot 0), replays the graph of the smallest size that fits, and reads the
logits of its real rows. Attention launch choices are fixed per graph (a TritonAttentionPlan with a set number
of splits, sized for the longest context), so the captured grid is valid for every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.triton_decode_attention import decode_num_splits
from kernels.dispatch import rows_as_decode
from kernels.triton_paged_attention import TritonAttentionPlan
from pipeline.models.attention import AttentionMetadata
from pipeline.models.forward_context import ForwardContext
from pipeline.runner.step_plan import ForwardBatch
from pipeline.runner.token_feed import TokenFeed


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


def decode_plan(rows: int, max_batch: int, num_kv_heads: int, max_model_len: int,
                num_sms: int) -> TritonAttentionPlan:
    """The attention launch plan of a decode step of ``rows`` sequences: the one the graph that serves it (the
    smallest captured size that holds it) is captured with. Eager decode steps use it too, so a sequence's keys are
    split, and their partial sums combined, the same way with graphs or without; the step's own heuristic would
    split by the step's longest context and sum in another order (graphs against eager diverged on bf16 ties)."""
    size = next((s for s in graph_batch_sizes(max_batch) if s >= rows), rows)
    return TritonAttentionPlan(num_splits=decode_num_splits(size, num_kv_heads, max_model_len, num_sms))


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size * q, vocab] float32, written by every replay


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, caches: list[torch.Tensor], *, max_batch: int,
                 max_blocks_per_seq: int, max_model_len: int, num_kv_heads: int, device: torch.device,
                 max_query_len: int = 1, keeps_states: bool = False, rows_as_decode: bool = False) -> None:
        """``keeps_states``: the graphs take per-token keep slots (hybrid models verifying drafts,
        ``ForwardContext.keep_slots``); without, a batch that keeps states does not fit them. ``rows_as_decode``:
        the one-sequence graphs compute each verify token as a one-token row (``kernels.dispatch.rows_as_decode``;
        exact speculation)."""
        self.model = model
        self.rows_as_decode = rows_as_decode
        self.keeps_states = keeps_states
        self.caches = caches
        self.max_batch = max_batch
        self.max_blocks = max_blocks_per_seq
        self.max_query_len = max_query_len
        n, w, t = max_batch, max_blocks_per_seq, max_batch * max_query_len
        # The per-token and per-row inputs are views of one int64 and one int32 buffer: a step copies each whole
        # (tens of KB) in one call, where a copy per input cost more host time than the bytes (B1 speculation).
        self.packed64 = torch.zeros(3 * t, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slots = self.packed64.view(3, t)
        self.slots.fill_(-1)
        self.packed32 = torch.zeros(2 * n + t, dtype=torch.int32, device=device)
        self.seq_lens, self.state_slots, self.keep_slots = self.packed32.split([n, n, t])
        self.seq_lens.fill_(1)  # (state_slots: padding rows take the null slot 0)
        self.keep_slots.fill_(-1)
        if not keeps_states:
            self.keep_slots = None
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        # row b's tokens start at b * q: one query_start_loc per q
        self.query_start_locs = {q: torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=device)
                                 for q in range(1, max_query_len + 1)}
        # Two sets of pinned staging buffers, used in turn: while step N's copies may still be queued
        # behind step N-1 on the stream, step N+1 is being written into the other set.
        self.staging = [{name: torch.zeros(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                         for name, tensor in (("packed64", self.packed64), ("packed32", self.packed32),
                                              ("block_tables", self.block_tables))} for _ in range(2)]
        # numpy views of each set's inputs, written without a torch call each
        self.staging_arrays = [self._host_views(host, n, t) for host in self.staging]
        self.staged: list[torch.cuda.Event | None] = [None, None]  # set once a set's copies are queued
        self.turn = 0
        self.sizes = graph_batch_sizes(max_batch)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self._capture(max_model_len, num_kv_heads, device)

    @staticmethod
    def _host_views(host: dict[str, torch.Tensor], n: int, t: int) -> dict[str, np.ndarray]:
        ids, positions, slots = host["packed64"].numpy().reshape(3, t)
        packed32 = host["packed32"].numpy()
        return {"input_ids": ids, "positions": positions, "slots": slots, "seq_lens": packed32[:n],
                "state_slots": packed32[n:2 * n], "keep_slots": packed32[2 * n:],
                "block_tables": host["block_tables"].numpy()}

    def _meta(self, size: int, q: int, plan: TritonAttentionPlan, max_model_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:size * q], query_start_loc=self.query_start_locs[q][: size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            query_start_loc_host=list(range(0, (size + 1) * q, q)), seq_lens_host=[max_model_len] * size,
            max_query_len=q, max_seq_len=max_model_len, is_decode_only=q == 1, kernel_plan=plan)

    @torch.inference_mode()
    def _capture(self, max_model_len: int, num_kv_heads: int, device: torch.device) -> None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        pool = torch.cuda.graph_pool_handle()
        self.seq_lens.fill_(self.max_query_len)  # every captured row's context holds its q tokens
        for q in range(self.max_query_len, 0, -1):
            for size in sorted(self.sizes, reverse=True):  # largest first: smaller ones reuse its pool
                plan = decode_plan(size, self.max_batch, num_kv_heads, max_model_len, sms)
                keeps = None if self.keep_slots is None else self.keep_slots[:size * q]
                context = ForwardContext(self._meta(size, q, plan, max_model_len), self.caches,
                                         state_slots=self.state_slots[:size], keep_slots=keeps)
                args = (self.input_ids[:size * q], self.positions[:size * q], context)
                with rows_as_decode(self.rows_as_decode and size == 1):
                    self.model.compute_logits(self.model(*args))  # compile kernels, settle allocations
                    torch.cuda.synchronize(device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        logits = self.model.compute_logits(self.model(*args))
                self.graphs[(size, q)] = _Graph(graph, logits)
        torch.cuda.synchronize(device)

    def fits(self, batch: int, query_len: int, blocks: int, keeps_states: bool = False) -> bool:
        return (batch <= self.max_batch and query_len <= self.max_query_len and blocks <= self.max_blocks
                and (self.keeps_states or not keeps_states))

    def run(self, batch: ForwardBatch, feed: TokenFeed | None = None) -> torch.Tensor:
        """Replay the graph for this uniform batch; returns logits [B * q, vocab] (valid until the next replay)."""
        rows, width = batch.block_tables.shape
        q = batch.num_tokens // rows
        tokens = rows * q
        size = next(s for s in self.sizes if s >= rows)
        host = self.staging[self.turn]
        arrays = self.staging_arrays[self.turn]
        previous_copies = self.staged[self.turn]
        if previous_copies is not None:
            previous_copies.synchronize()  # normally long done: that set fed the step before last
        arrays["input_ids"][:tokens] = batch.input_ids
        arrays["positions"][:tokens] = batch.positions
        arrays["slots"][:tokens] = batch.slot_mapping
        arrays["seq_lens"][:rows] = batch.seq_lens
        arrays["state_slots"][:rows] = batch.state_slots
        arrays["keep_slots"][:tokens] = batch.keep_slots  # (-1 where the graphs keep no states: not read)
        # Only the first `width` table columns are copied: a row never reads a column past its length.
        arrays["block_tables"][:rows, :width] = batch.block_tables
        if size > rows:  # padded rows: nothing written, q harmless keys of the null block read
            arrays["input_ids"][tokens:size * q] = 0
            arrays["positions"][tokens:size * q] = 0
            arrays["slots"][tokens:size * q] = -1
            arrays["seq_lens"][rows:size] = q
            arrays["state_slots"][rows:size] = 0
            arrays["keep_slots"][tokens:size * q] = -1
            arrays["block_tables"][rows:size, :width] = 0
        # (past a graph's size * q tokens and size rows the buffers hold stale values no replay of it reads)
        self.packed64.copy_(host["packed64"], non_blocking=True)
        self.packed32.copy_(host["packed32"], non_blocking=True)
        self.block_tables[:size, :width].copy_(host["block_tables"][:size, :width], non_blocking=True)
        copied = previous_copies if previous_copies is not None else torch.cuda.Event()
        copied.record()  # (an event recorded again marks the newer copies)
        self.staged[self.turn] = copied
        self.turn ^= 1
        if feed is not None:
            feed.apply(self.input_ids)
        entry = self.graphs[(size, q)]
        entry.graph.replay()
        return entry.logits[:tokens]
