"""CUDA graphs for decode steps: one replay instead of hundreds of kernel launches per token.

A graph is captured per padded batch size (1, 2, 4, 8, then multiples of 8 up to max_batch) over
static device buffers. A decode step copies its inputs from pinned host buffers into them (one
non-blocking copy each; tokens still on the device from the previous step are copied in on the
device), pads the unused rows (slot -1: the KV write skips it; length 1 over the
null block), replays the graph of the smallest size that fits, and reads the logits of its real rows.
Attention launch choices are fixed per graph (TritonAttentionPlan with a set number of splits,
sized for the longest context), so the captured grid is valid for every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.triton_paged_attention import TritonAttentionPlan, decode_num_splits
from pipeline.models.attention import AttentionMetadata
from pipeline.runner.token_feed import TokenFeed


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size, vocab] float32, written by every replay


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], *, max_batch: int,
                 max_blocks_per_seq: int, max_model_len: int, num_kv_heads: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_batch = max_batch
        self.max_blocks = max_blocks_per_seq
        n, w = max_batch, max_blocks_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # Two sets of pinned staging buffers, used in turn: while step N's copies may still be queued
        # behind step N-1 on the stream, step N+1 is being written into the other set.
        self.staging = [{name: torch.zeros(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                         for name, tensor in self._buffers().items()} for _ in range(2)]
        self.staged: list[torch.cuda.Event | None] = [None, None]  # set once a set's copies are queued
        self.turn = 0
        self.sizes = graph_batch_sizes(max_batch)
        self.graphs: dict[int, _Graph] = {}
        self._capture(max_model_len, num_kv_heads, device)

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "positions": self.positions, "slots": self.slots,
                "seq_lens": self.seq_lens, "block_tables": self.block_tables}

    def _meta(self, size: int, plan: TritonAttentionPlan, max_model_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:size], query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            query_start_loc_host=list(range(size + 1)), seq_lens_host=[max_model_len] * size,
            max_query_len=1, max_seq_len=max_model_len, is_decode_only=True, kernel_plan=plan)

    @torch.inference_mode()
    def _capture(self, max_model_len: int, num_kv_heads: int, device: torch.device) -> None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):  # largest first: smaller ones reuse its pool
            plan = TritonAttentionPlan(num_splits=decode_num_splits(size, num_kv_heads, max_model_len, sms))
            meta = self._meta(size, plan, max_model_len)
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
            self.model.compute_logits(self.model(*args))  # compile kernels, settle allocations
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.compute_logits(self.model(*args))
            self.graphs[size] = _Graph(graph, logits)
        torch.cuda.synchronize(device)

    def fits(self, batch: int, blocks: int) -> bool:
        return batch <= self.max_batch and blocks <= self.max_blocks

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
            block_tables: np.ndarray, feed: TokenFeed | None = None) -> torch.Tensor:
        """Replay the decode graph for these B rows; returns logits [B, vocab] (valid until the next replay)."""
        batch, width = block_tables.shape
        size = next(s for s in self.sizes if s >= batch)
        host = self.staging[self.turn]
        previous_copies = self.staged[self.turn]
        if previous_copies is not None:
            previous_copies.synchronize()  # normally long done: that set fed the step before last
        host["input_ids"][:batch] = torch.from_numpy(input_ids)
        host["positions"][:batch] = torch.from_numpy(positions)
        host["slots"][:batch] = torch.from_numpy(slots)
        host["seq_lens"][:batch] = torch.from_numpy(seq_lens)
        # Only the first `width` table columns are copied: a row never reads a column past its length.
        host["block_tables"][:batch, :width] = torch.from_numpy(block_tables)
        if size > batch:  # padded rows: nothing written, one harmless key of the null block read
            host["input_ids"][batch:size] = 0
            host["positions"][batch:size] = 0
            host["slots"][batch:size] = -1
            host["seq_lens"][batch:size] = 1
            host["block_tables"][batch:size, :width] = 0
        for name, device_buffer in self._buffers().items():
            if name == "block_tables":
                device_buffer[:size, :width].copy_(host[name][:size, :width], non_blocking=True)
            else:
                device_buffer[:size].copy_(host[name][:size], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.staged[self.turn] = copied
        self.turn ^= 1
        if feed is not None:
            feed.apply(self.input_ids)
        entry = self.graphs[size]
        entry.graph.replay()
        return entry.logits[:batch]
