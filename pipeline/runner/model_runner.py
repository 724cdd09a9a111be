"""Runs one step plan on the device: build inputs, forward, pick tokens through the one sampler.

Owned by the executor thread; nothing here touches asyncio or stage state.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import ext
from pipeline.models.attention import AttentionMetadata, build_attention_metadata
from pipeline.runner.cuda_graphs import DecodeGraphs
from pipeline.runner.host_staging import HostStaging
from pipeline.runner.sampler import DeviceSample, Sampler, SamplerOutput
from pipeline.runner.sampling_batch import SamplingBatch
from pipeline.runner.step_plan import StepPlan
from pipeline.runner.token_feed import TokenFeed

_step_inputs = ext.load("step_inputs")


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def empty_sample(device: torch.device) -> DeviceSample:
    return DeviceSample(torch.empty(0, dtype=torch.int64, device=device),
                        torch.empty(0, 1, dtype=torch.float64, device=device), 0, np.empty(0, dtype=np.int64), False)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = device
        self.kv_shape = (num_layers, num_kv_heads, head_dim)
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None
        self.sampler = Sampler()
        self.staging = HostStaging()  # this runner's reused host buffers (only its launches touch them)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        num_layers, num_kv_heads, head_dim = self.kv_shape
        self.kv_caches = [
            torch.zeros(2, num_blocks, self.block_size, num_kv_heads, head_dim, dtype=self.dtype, device=self.device)
            for _ in range(num_layers)
        ]

    @torch.inference_mode()
    def kv_blocks_for_gpu(self, utilization: float, profile_tokens: int, profile_rows: int,
                          reserve_bytes: int = 1 << 30) -> int:
        """KV blocks that fit in `utilization` of the device after weights and the peak activations of
        the largest step (a profiling prefill of `profile_tokens` tokens, logits for `profile_rows`)."""
        num_layers, num_kv_heads, head_dim = self.kv_shape
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        blocks = -(-profile_tokens // self.block_size) + 1
        scratch = [torch.zeros(2, blocks, self.block_size, num_kv_heads, head_dim, dtype=self.dtype,
                               device=self.device) for _ in range(num_layers)]
        meta = build_attention_metadata([profile_tokens], [profile_tokens], [list(range(1, blocks))],
                                        self.block_size, self.device)
        ids = torch.zeros(profile_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(profile_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, positions, scratch, meta)
        self.model.compute_logits(hidden[-min(profile_rows, profile_tokens):].repeat(
            -(-profile_rows // min(profile_rows, profile_tokens)), 1)[:profile_rows])
        torch.cuda.synchronize(self.device)
        scratch_bytes = sum(t.numel() * t.element_size() for t in scratch)
        activations = torch.cuda.max_memory_allocated(self.device) - baseline - scratch_bytes
        del scratch, hidden
        torch.cuda.empty_cache()
        budget = total * utilization - (total - free) - activations - reserve_bytes
        block_bytes = kv_bytes_per_block(num_layers, num_kv_heads, head_dim, self.block_size, self.dtype)
        if budget < 2 * block_bytes:
            raise RuntimeError(f"no room for the KV cache: {total * utilization / 2**30:.1f} GiB allowed, "
                               f"{(total - free) / 2**30:.1f} GiB used by weights, "
                               f"{activations / 2**30:.1f} GiB by activations")
        return int(budget // block_bytes)

    def release(self) -> None:
        """Drop the KV cache, graphs and weights (on the device thread) so the memory returns at shutdown."""
        self.graphs = None
        self.kv_caches = []
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        self.graphs = DecodeGraphs(self.model, self.kv_caches, max_batch=max_batch,
                                   max_blocks_per_seq=-(-max_model_len // self.block_size),
                                   max_model_len=max_model_len, num_kv_heads=self.kv_shape[1], device=self.device)

    def execute(self, plan: StepPlan) -> SamplerOutput:
        """Run a step and wait for its results (tests and tools; the engine launches and fetches apart)."""
        return self.launch(plan).to_host()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None,
               previous_host: Callable[[], np.ndarray] | None = None) -> DeviceSample:
        """Queue a step on the device and return at once; its results arrive with `to_host()`.

        `previous_tokens` are the device token ids of the previous step of the stage that planned
        this one, for chunks that name theirs by row (`previous_row`); `previous_host()` gives the
        same ids on the host (waiting for them), for grammar rows one step ahead.
        """
        chunks = plan.chunks
        if not chunks:
            return empty_sample(self.device)
        input_ids, positions, slots, qsl, seq_lens, tables = _step_inputs.build_step_inputs(
            [c.token_ids for c in chunks], [c.start_pos for c in chunks], [c.block_ids for c in chunks], self.block_size
        )
        rows = [row for c in chunks for row in c.rows]
        # Sampling inputs go to the device before the forward is launched: their small copies then
        # never wait behind the step's kernels (on CUDA a pageable copy blocks the host until it lands).
        batch = SamplingBatch.from_rows(rows, self.vocab_size, self.device, self.staging) if rows else None
        feed = TokenFeed.for_chunks(chunks, qsl, previous_tokens)
        decode_only = len(input_ids) == len(chunks)
        if (self.graphs is not None and decode_only and len(rows) == len(chunks)
                and self.graphs.fits(len(chunks), tables.shape[1])):
            logits = self.graphs.run(input_ids, positions, slots, seq_lens, tables, feed)
            batch.fill_grammar_bitmask(previous_host)  # host work while the graph runs
            return self.sampler.sample(logits, batch)
        qsl_host = qsl.tolist()
        lens_host = seq_lens.tolist()
        query_lens = [qsl_host[i + 1] - qsl_host[i] for i in range(len(chunks))]
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots),
            query_start_loc=self._to_device(qsl),
            seq_lens=self._to_device(seq_lens),
            block_tables=self._to_device(tables),
            query_start_loc_host=qsl_host,
            seq_lens_host=lens_host,
            max_query_len=max(query_lens),
            max_seq_len=max(lens_host),
            is_decode_only=decode_only,
        )
        last_index = self._to_device(np.asarray([qsl_host[i + 1] - 1 for i, c in enumerate(chunks) for _ in c.rows],
                                                dtype=np.int64))
        ids = self._to_device(input_ids)
        if feed is not None:
            if not ids.is_cuda:
                ids = ids.clone()  # a view of the plan's host array on CPU; do not write into it
            feed.apply(ids)
        hidden = self.model(ids, self._to_device(positions), self.kv_caches, meta)
        if batch is None:
            return empty_sample(self.device)
        logits = self.model.compute_logits(hidden[last_index])
        batch.fill_grammar_bitmask(previous_host)  # host work while the forward runs (on CUDA)
        return self.sampler.sample(logits, batch)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor
