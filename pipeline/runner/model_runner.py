"""Runs one step plan on the device: build inputs, forward, pick tokens through the one sampler.

Owned by the executor thread; nothing here touches asyncio or stage state.
"""
from __future__ import annotations

import numpy as np
import torch

import ext
from pipeline.models.attention import AttentionMetadata
from pipeline.runner.sampler import Sampler, SamplerOutput
from pipeline.runner.sampling_batch import SamplingBatch
from pipeline.runner.step_plan import StepPlan

_step_inputs = ext.load("step_inputs")


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def empty_output() -> SamplerOutput:
    return SamplerOutput(token_ids=np.empty(0, dtype=np.int64), logprobs=None, top_ids=None, top_logprobs=None)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = device
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> SamplerOutput:
        chunks = plan.chunks
        if not chunks:
            return empty_output()
        input_ids, positions, slots, qsl, seq_lens, tables = _step_inputs.build_step_inputs(
            [c.token_ids for c in chunks], [c.start_pos for c in chunks], [c.block_ids for c in chunks], self.block_size
        )
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
            is_decode_only=all(n == 1 for n in query_lens),
        )
        hidden = self.model(self._to_device(input_ids), self._to_device(positions), self.kv_caches, meta)
        rows = [row for c in chunks for row in c.rows]
        if not rows:
            return empty_output()
        last_index = [qsl_host[i + 1] - 1 for i, c in enumerate(chunks) for _ in c.rows]
        logits = self.model.compute_logits(hidden[torch.tensor(last_index, device=self.device)])
        batch = SamplingBatch.from_rows(rows, self.vocab_size, self.device)
        return self.sampler(logits, batch)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor
