"""Runs one step plan on the device, in three parts that a second process could split:

- `prepare`: a plan's forward batch (host arrays) -> a `DeviceBatch`: its tensors on the device and
  the forward context (or a CUDA graph chosen for it);
- `forward`: what every rank runs for a step: the fed tokens copied in, the model, the logits at the
  batch's logits indices;
- `sample`: rank 0 only: the grammar masks and the one sampler (the logits pipeline).

Owned by the executor thread; nothing here touches asyncio or stage state.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.dispatch import MAX_DECODE_ROW_TOKENS, rows_as_decode
from pipeline.memory.block_transfers import run_block_transfers
from pipeline.models.attention import AttentionMetadata, build_attention_metadata
from pipeline.models.forward_context import (CacheSpec, ForwardContext, PagedKVSpec, StateSlotSpec, allocate_caches,
                                             bytes_per_block, bytes_per_state_slot)
from pipeline.runner.cuda_graphs import DecodeGraphs, decode_plan
from pipeline.runner.host_staging import HostStaging
from pipeline.runner.sampler import DeviceSample, Sampler, SamplerOutput
from pipeline.runner.sampling_batch import SamplingBatch
from pipeline.runner.step_plan import ForwardBatch, StepPlan
from pipeline.runner.token_feed import TokenFeed
from pipeline.spec.device_drafts import DeviceDrafts

if TYPE_CHECKING:
    from pipeline.dist.comm import CommStage


def empty_sample(device: torch.device) -> DeviceSample:
    return DeviceSample(torch.empty(0, dtype=torch.int64, device=device),
                        torch.empty(0, 1, dtype=torch.float64, device=device), 0, np.empty(0, dtype=np.int64), False)


@dataclass(slots=True)
class DeviceBatch:
    """A forward batch made ready on the device. With `graph` set, a CUDA graph replays it (the
    graph copies the host arrays into its own buffers); otherwise the tensors and context are set."""

    batch: ForwardBatch
    graph: bool
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    context: ForwardContext | None = None
    logits_indices: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, vocab_size: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, max_num_seqs: int = 0, extra_cache_specs: Sequence[CacheSpec] = (),
                 kv_dtype: torch.dtype | None = None) -> None:
        """``max_num_seqs``: sequences that can hold a recurrent state slot at once (hybrid models).
        ``extra_cache_specs``: caches after the model's, in the same blocks (a draft model's, pipeline/spec/).
        ``kv_dtype``: the model's attention K/V (--kv-cache-dtype; None: ``dtype``)."""
        self.model = model
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.cache_specs = model.cache_specs(dtype, self.kv_dtype) + list(extra_cache_specs)
        self.num_state_slots = max_num_seqs + 1 if bytes_per_state_slot(self.cache_specs) else 0  # + the null slot
        self.caches: list[torch.Tensor] = []
        self.snapshots: list[torch.Tensor] = []  # per recurrent cache: [snapshots, ...] (allocate_snapshots)
        self.graphs: DecodeGraphs | None = None
        # (max_batch, max_model_len, SMs): fix_decode_partition
        self.decode_partition: tuple[int, int, int] | None = None
        self.sampler = Sampler()
        self.staging = HostStaging()  # this runner's reused host buffers (only its launches touch them)
        # KV tier copies' host side runs here, beside the forward (pipeline/memory/block_transfers.py)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.comm: CommStage | None = None  # expert parallelism, on the head: the workers hear of every step
        # exact speculation: a one-sequence step's verify row computes each token as a one-token decode row does
        # (kernels/dispatch.py rows_as_decode), so speculation keeps plain decoding's bits; larger batches take the
        # multi-row kernels as without it (plain decoding's own rows are multi-row there)
        self.rows_as_decode = False

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.cache_specs, self.block_size)

    @property
    def state_bytes(self) -> int:
        """Device bytes of every recurrent state slot (allocated beside the KV blocks)."""
        return self.num_state_slots * bytes_per_state_slot(self.cache_specs)

    def allocate_caches(self, num_blocks: int) -> None:
        self.caches = allocate_caches(self.cache_specs, num_blocks, self.block_size, self.device, self.num_state_slots)

    @property
    def bytes_per_snapshot(self) -> int:
        """Device bytes of one recurrent-state snapshot (every GDN layer's state; 0 for attention-only models)."""
        return bytes_per_state_slot(self.cache_specs)

    def allocate_snapshots(self, count: int) -> None:
        """``count`` snapshots of every recurrent cache (pipeline/memory/state_snapshots.py)."""
        self.snapshots = [torch.zeros((count, *spec.per_slot), dtype=spec.dtype, device=self.device)
                          for spec in self.cache_specs if isinstance(spec, StateSlotSpec)]

    @property
    def state_caches(self) -> list[torch.Tensor]:
        """The recurrent state caches ``[slots, ...]``, in cache order (what a snapshot copies)."""
        return [c for c, spec in zip(self.caches, self.cache_specs) if isinstance(spec, StateSlotSpec)]

    @property
    def paged_caches(self) -> list[torch.Tensor]:
        """The paged K/V caches (one per attention layer), in cache order: what a KV tier block holds."""
        return [c for c, spec in zip(self.caches, self.cache_specs) if isinstance(spec, PagedKVSpec)]

    @torch.inference_mode()
    def kv_blocks_for_gpu(self, utilization: float, profile_tokens: int, profile_rows: int,
                          reserve_bytes: int = 1 << 30) -> int:
        """KV blocks that fit in `utilization` of the device after weights and the peak activations of
        the largest step (a profiling prefill of `profile_tokens` tokens, logits for `profile_rows`)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        blocks = -(-profile_tokens // self.block_size) + 1
        scratch = allocate_caches(self.cache_specs, blocks, self.block_size, self.device, self.num_state_slots)
        meta = build_attention_metadata([profile_tokens], [profile_tokens], [list(range(1, blocks))],
                                        self.block_size, self.device)
        ids = torch.zeros(profile_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(profile_tokens, dtype=torch.int64, device=self.device)
        null_slot = torch.zeros(1, dtype=torch.int32, device=self.device)
        hidden = self.model(ids, positions, ForwardContext(meta, scratch, state_slots=null_slot))
        self.model.compute_logits(hidden[-min(profile_rows, profile_tokens):].repeat(
            -(-profile_rows // min(profile_rows, profile_tokens)), 1)[:profile_rows])
        # smaller steps too: kernels pick launch configs by step size (the MoE's tiles), and a config first met
        # while serving would stall that step for the compiler
        for tokens in warmup_token_counts(profile_tokens):
            small = build_attention_metadata([tokens], [tokens], [list(range(1, blocks))], self.block_size,
                                             self.device)
            self.model(ids[:tokens], positions[:tokens], ForwardContext(small, scratch, state_slots=null_slot))
        # and a prompt's last tokens after a long cached prefix: the prefill attention's key-split variant
        tail = min(16, profile_tokens)
        late = build_attention_metadata([tail], [profile_tokens], [list(range(1, blocks))], self.block_size,
                                        self.device)
        self.model(ids[:tail], positions[-tail:], ForwardContext(late, scratch, state_slots=null_slot))
        torch.cuda.synchronize(self.device)
        scratch_bytes = sum(t.numel() * t.element_size() for t in scratch)
        activations = torch.cuda.max_memory_allocated(self.device) - baseline - scratch_bytes
        del scratch, hidden
        torch.cuda.empty_cache()
        # the state slots are part of the scratch above and allocated again beside the blocks
        budget = total * utilization - (total - free) - activations - reserve_bytes - self.state_bytes
        if budget < 2 * self.bytes_per_block:
            raise RuntimeError(f"no room for the KV cache: {total * utilization / 2**30:.1f} GiB allowed, "
                               f"{(total - free) / 2**30:.1f} GiB used by weights, "
                               f"{activations / 2**30:.1f} GiB by activations")
        return int(budget // self.bytes_per_block)

    def release(self) -> None:
        """Drop the caches, graphs and weights (on the device thread) so the memory returns at shutdown."""
        self.graphs = None
        self.caches = []
        self.snapshots = []
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def fix_decode_partition(self, max_batch: int, max_model_len: int) -> None:
        """Eager decode steps on the GPU take the attention plan their CUDA graph would (``decode_plan``), whether or
        not graphs are captured: the same tokens give the same logits either way."""
        self.decode_partition = (max_batch, max_model_len,
                                 torch.cuda.get_device_properties(self.device).multi_processor_count)

    def capture_decode_graphs(self, max_batch: int, max_model_len: int, max_query_len: int = 1) -> None:
        self.fix_decode_partition(max_batch, max_model_len)
        self.graphs = DecodeGraphs(self.model, self.caches, max_batch=max_batch,
                                   max_blocks_per_seq=-(-max_model_len // self.block_size),
                                   max_model_len=max_model_len,
                                   num_kv_heads=self._num_kv_heads(),
                                   device=self.device, max_query_len=max_query_len,
                                   keeps_states=max_query_len > 1 and self.num_state_slots > 0,
                                   rows_as_decode=self.rows_as_decode)

    def _num_kv_heads(self) -> int:
        return next(s.num_kv_heads for s in self.cache_specs if isinstance(s, PagedKVSpec))

    def execute(self, plan: StepPlan) -> SamplerOutput:
        """Run a step and wait for its results (tests and tools; the engine launches and fetches apart)."""
        return self.launch(plan).to_host()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None,
               previous_host: Callable[[], np.ndarray] | None = None) -> DeviceSample:
        """Queue a step on the device and return at once; its results arrive with `to_host()`.

        `previous_tokens` are the device token ids of the previous step of the stage that planned
        this one, for tokens named by row (`feed_sources`); `previous_host()` gives the same ids on
        the host (waiting for them), for grammar rows one step ahead.
        """
        fed = plan.fed_tokens
        if fed is not None:  # the feeds index drafts left on the device, not a previous step's tokens
            previous_tokens, previous_host = (fed.ids() if isinstance(fed, DeviceDrafts) else fed), None
        comm = self.comm
        if comm is not None:
            comm.send_step(plan, previous_tokens)
        if plan.transfers is not None:  # KV tier copies first: the forward may read restored blocks
            run_block_transfers(plan.transfers, self.paged_caches, self.state_caches, self.snapshots, self.copy_stream)
        if comm is not None:
            comm.share(plan, previous_tokens, self.paged_caches, self.snapshots)
        if plan.forward.num_tokens == 0:
            return empty_sample(self.device)
        # Sampling inputs go to the device before the forward is launched: their small copies then
        # never wait behind the step's kernels (on CUDA a pageable copy blocks the host until it lands).
        sampling = (SamplingBatch.from_rows(list(plan.rows), self.vocab_size, self.device, self.staging)
                    if plan.rows else None)
        logits = self.forward(self.prepare(plan.forward), previous_tokens)
        if sampling is None:
            return empty_sample(self.device)
        return self.sample(logits, sampling, previous_host)

    @torch.inference_mode()
    def compute_logits(self, batch: ForwardBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [S, vocab] at the batch's logits indices (tests and tools: no sampling)."""
        return self.forward(self.prepare(batch), previous_tokens)

    def prepare(self, batch: ForwardBatch) -> DeviceBatch:
        graphs = self.graphs
        keeps_states = batch.keeps_states
        if graphs is not None and batch.is_uniform_decode and graphs.fits(
                batch.num_seqs, batch.num_tokens // batch.num_seqs, batch.block_tables.shape[1], keeps_states):
            return DeviceBatch(batch, graph=True)
        kernel_plan = None
        # one-token rows, or a verify row taken as one-token rows: the decode partition
        decode_rows = batch.num_tokens == batch.num_seqs or self._rows_as_decode(batch)
        if self.decode_partition is not None and self.device.type == "cuda" and decode_rows:
            max_batch, max_model_len, sms = self.decode_partition
            kernel_plan = decode_plan(batch.num_seqs, max_batch, self._num_kv_heads(), max_model_len, sms)
        meta = forward_metadata(batch, self._to_device, kernel_plan)
        keeps = self._to_device(batch.keep_slots) if keeps_states else None
        context = ForwardContext(meta, self.caches, state_slots=self._to_device(batch.state_slots), keep_slots=keeps)
        return DeviceBatch(batch, False, self._to_device(batch.input_ids), self._to_device(batch.positions),
                           context, self._to_device(batch.logits_indices))

    def forward(self, prepared: DeviceBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [S, vocab] float32 at the batch's logits indices, queued on the device."""
        batch = prepared.batch
        feed = TokenFeed.of(batch.feed_targets, batch.feed_sources, previous_tokens)
        if prepared.graph:
            assert self.graphs is not None
            return self.graphs.run(batch, feed)
        ids = prepared.input_ids
        assert ids is not None and prepared.context is not None and prepared.logits_indices is not None
        if feed is not None:
            if not ids.is_cuda:
                ids = ids.clone()  # a view of the plan's host array on CPU; do not write into it
            feed.apply(ids)
        with rows_as_decode(self._rows_as_decode(batch)):
            hidden = self.model(ids, prepared.positions, prepared.context)
            if batch.num_logits == 0:  # prompt chunks short of their end
                return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
            return self.model.compute_logits(hidden[prepared.logits_indices])

    def _rows_as_decode(self, batch: ForwardBatch) -> bool:
        """Exact speculation's one-sequence steps of up to MAX_DECODE_ROW_TOKENS tokens (``rows_as_decode``)."""
        return self.rows_as_decode and batch.num_seqs == 1 and batch.num_tokens <= MAX_DECODE_ROW_TOKENS

    def sample(self, logits: torch.Tensor, sampling: SamplingBatch,
               previous_host: Callable[[], np.ndarray] | None = None) -> DeviceSample:
        sampling.fill_grammar_bitmask(previous_host)  # host work while the forward runs (on CUDA)
        return self.sampler.sample(logits, sampling)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor


def warmup_token_counts(largest: int) -> list[int]:
    """Step sizes a profiling pass also runs (powers of 4 from 16 below ``largest``): one per launch-config
    bucket of the kernels that choose by size."""
    return [4 ** i for i in range(2, 12) if 4 ** i < largest]


def forward_metadata(batch: ForwardBatch, to_device: Callable[[np.ndarray], torch.Tensor],
                     kernel_plan: object | None = None) -> AttentionMetadata:
    """A forward batch's attention metadata, its arrays moved by ``to_device`` (an eager forward's)."""
    qsl_host = batch.query_start_loc.tolist()
    lens_host = batch.seq_lens.tolist()
    max_query_len = max(qsl_host[i + 1] - qsl_host[i] for i in range(len(lens_host)))
    return AttentionMetadata(
        slot_mapping=to_device(batch.slot_mapping),
        query_start_loc=to_device(batch.query_start_loc),
        seq_lens=to_device(batch.seq_lens),
        block_tables=to_device(batch.block_tables),
        query_start_loc_host=qsl_host,
        seq_lens_host=lens_host,
        max_query_len=max_query_len,
        max_seq_len=max(lens_host),
        is_decode_only=max_query_len == 1,
        kernel_plan=kernel_plan,
    )
