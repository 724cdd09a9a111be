"""What one device step computes, as arrays built once, and what comes back.

A stage describes its part of a step as `ScheduledChunk`s (a run of tokens of one sequence, the
sequence's block list, the sampling rows). `build_step_plan` flattens them at once, on the event
loop, into a `ForwardBatch`: integer arrays that copy what they need (a block list's prefix, the
tokens), so no plan shares anything with state the loop changes after it was built.

A chunk may carry several tokens and ask for logits at several of its positions (a prompt chunk:
its last; a decode row: its one token; a speculative verify row: all K+1). Its first token may be
one the previous step sampled and left on the device (`previous_row`), which the runner copies in on
the device (one step ahead); a verify row's drafts may be a drafter's picks still on the device
(`fed_drafts`), copied in the same way.

The plan splits along the process boundary: the `ForwardBatch` is tensor-only and versioned (what
every rank runs; it serialises to bytes), the sampling rows stay on rank 0 (live grammar and penalty
state: what the sampler reads at each logits position).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import ext
from pipeline.memory.block_transfers import BlockTransfers
from pipeline.memory.state_slots import NULL_SLOT, SlotChanges, StateSlot
from pipeline.runner.sampling_batch import SamplingRow

_step_inputs = ext.load("step_inputs")

FORWARD_BATCH_VERSION = 3


class ForwardBatchVersionError(ValueError):
    """A serialised forward batch of another layout version (ranks running different code)."""


@dataclass(slots=True)
class ScheduledChunk:
    token_ids: list[int]  # new tokens fed this step (a prompt chunk, a decode token, a token and its drafts)
    start_pos: int  # position of token_ids[0]; K/V of positions < start_pos are already cached
    block_ids: list[int]  # covers start_pos + len(token_ids) tokens (read, and copied, when the plan is built)
    rows: list[SamplingRow]  # tokens to pick; row i reads the logits at position logits_offsets[i]
    # >= 0: token_ids[0] is still on the device, sampled in row `previous_row` of the previous step
    # its stage launched (token_ids[0] is a placeholder).
    previous_row: int = -1
    logits_offsets: list[int] | None = None  # offsets within the chunk, one per row; None: all at the last
    state_slot: StateSlot | None = None  # hybrid models: the sequence's recurrent state slot, checked at build
    # hybrid verify rows: per token, the state slot that keeps the recurrent state as it stands after it (-1: none)
    keep_slots: list[int] | None = None
    # a verify row whose drafts are still on the device (pipeline/spec/device_drafts.py): (their ids, flat on the
    # device, or the DeviceDrafts that will hold them; the offset of the first in token_ids; its index in those ids;
    # how many), token_ids holding placeholders
    fed_drafts: tuple[Any, int, int, int] | None = None


_ARRAYS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
           "logits_indices", "feed_targets", "feed_sources", "state_slots", "keep_slots")
_DTYPES = (np.int64, np.int64, np.int64, np.int32, np.int32, np.int32, np.int64, np.int64, np.int64, np.int32,
           np.int32)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One forward's inputs: B rows, T tokens in row order, S logits positions, F fed tokens."""

    input_ids: np.ndarray  # int64 [T] (fed positions hold a placeholder)
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]: KV slot each token's K/V is written to
    query_start_loc: np.ndarray  # int32 [B+1]: row b owns tokens qsl[b]:qsl[b+1]
    seq_lens: np.ndarray  # int32 [B]: context length including this step's tokens
    block_tables: np.ndarray  # int32 [B, W], padded with the null block
    logits_indices: np.ndarray  # int64 [S]: token indices whose logits are computed, in row order
    feed_targets: np.ndarray  # int64 [F]: token indices that take a previous step's token ...
    feed_sources: np.ndarray  # int64 [F]: ... from these rows of that step's sampled tokens
    state_slots: np.ndarray  # int32 [B]: each row's recurrent state slot (all NULL_SLOT for attention-only models)
    # int32 [T]: the state slot keeping the recurrent state as it stands after each token (-1: none; None: all -1)
    keep_slots: np.ndarray | None = None
    version: int = FORWARD_BATCH_VERSION

    def __post_init__(self) -> None:
        if self.keep_slots is None:
            object.__setattr__(self, "keep_slots", np.full(len(self.input_ids), -1, dtype=np.int32))

    @property
    def keeps_states(self) -> bool:
        return bool((self.keep_slots >= 0).any())

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_logits(self) -> int:
        return len(self.logits_indices)

    @property
    def is_uniform_decode(self) -> bool:
        """Every row has the same number of tokens and wants logits at each of them (a CUDA graph's shape)."""
        b, t = self.num_seqs, self.num_tokens
        return b > 0 and t % b == 0 and self.num_logits == t and bool(
            (self.logits_indices == np.arange(t)).all()) and bool(
            (np.diff(self.query_start_loc) == t // b).all())

    def to_bytes(self) -> bytes:
        """The wire form: a header (version, array lengths, table width) then the arrays' bytes."""
        header = np.array([self.version, self.num_tokens, self.num_seqs, self.block_tables.shape[1],
                           self.num_logits, len(self.feed_targets)], dtype=np.int64)
        return header.tobytes() + b"".join(
            np.ascontiguousarray(getattr(self, name), dtype=dtype).tobytes() for name, dtype in zip(_ARRAYS, _DTYPES))

    @classmethod
    def from_bytes(cls, data: bytes) -> ForwardBatch:
        header = np.frombuffer(data, dtype=np.int64, count=6)
        version = int(header[0])
        if version != FORWARD_BATCH_VERSION:
            raise ForwardBatchVersionError(f"forward batch version {version}, this rank reads {FORWARD_BATCH_VERSION}")
        t, b, w, s, f = (int(x) for x in header[1:])
        shapes = ((t,), (t,), (t,), (b + 1,), (b,), (b, w), (s,), (f,), (f,), (b,), (t,))
        arrays: dict[str, np.ndarray] = {}
        offset = header.nbytes
        for name, dtype, shape in zip(_ARRAYS, _DTYPES, shapes):
            count = int(np.prod(shape))
            arrays[name] = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape).copy()
            offset += count * np.dtype(dtype).itemsize
        if offset != len(data):
            raise ValueError(f"forward batch of {len(data)} bytes, its header describes {offset}")
        return cls(**arrays, version=version)


@dataclass(frozen=True, slots=True)
class StepPlan:
    forward: ForwardBatch
    rows: tuple[SamplingRow, ...]  # rank 0's sampling rows: rows[i] reads logits at forward.logits_indices[i]
    transfers: BlockTransfers | None = None  # KV tier copies the runner runs before the forward (block_transfers.py)
    # expert parallelism (pipeline/dist/): each row's state-slot epoch (0: the null slot) and the state slots
    # allocated and released since the previous plan, for the workers' ledgers
    state_epochs: np.ndarray | None = None
    slot_changes: SlotChanges | None = None
    # the device ids the forward's fed tokens index when they are drafts left on the device, not the previous step's
    # (a tensor, or DeviceDrafts: the runner takes their ids at launch)
    fed_tokens: Any = None

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return self.forward.num_tokens


def build_step_plan(chunks: list[ScheduledChunk], block_size: int, state_slots: list[int] | None = None,
                    transfers: BlockTransfers | None = None, slot_changes: SlotChanges | None = None) -> StepPlan:
    """``state_slots``: each chunk's checked state slot index (``CacheManager.state_slot_indices``), or None;
    ``transfers``: the cache's tier copies for this step (``CacheManager.take_transfers``); ``slot_changes``: its
    state slots' allocations and releases since the last plan (``CacheManager.take_slot_changes``)."""
    input_ids, positions, slots, qsl, seq_lens, tables = _step_inputs.build_step_inputs(
        [c.token_ids for c in chunks], [c.start_pos for c in chunks], [c.block_ids for c in chunks], block_size)
    logits: list[int] = []
    rows: list[SamplingRow] = []
    targets: list[int] = []
    sources: list[int] = []
    fed_tokens = None
    for i, chunk in enumerate(chunks):
        if chunk.rows:
            start = int(qsl[i])
            offsets = chunk.logits_offsets
            if offsets is None:
                logits.extend([start + len(chunk.token_ids) - 1] * len(chunk.rows))
            else:
                if len(offsets) != len(chunk.rows) or not all(0 <= o < len(chunk.token_ids) for o in offsets):
                    raise ValueError(f"chunk {i}: logits offsets {offsets} for {len(chunk.rows)} rows "
                                     f"of {len(chunk.token_ids)} tokens")
                logits.extend(start + o for o in offsets)
            rows.extend(chunk.rows)
        if chunk.previous_row >= 0:
            targets.append(int(qsl[i]))
            sources.append(chunk.previous_row)
        if chunk.fed_drafts is not None:
            tokens, offset, first, count = chunk.fed_drafts
            if fed_tokens is not None and tokens is not fed_tokens:
                raise ValueError(f"chunk {i}: drafts fed from another device tensor than the step's other rows")
            if not 0 <= offset <= len(chunk.token_ids) - count:
                raise ValueError(f"chunk {i}: {count} fed drafts at offset {offset} of {len(chunk.token_ids)} tokens")
            fed_tokens = tokens
            targets.extend(range(int(qsl[i]) + offset, int(qsl[i]) + offset + count))
            sources.extend(range(first, first + count))
    if fed_tokens is not None and any(c.previous_row >= 0 for c in chunks):
        raise ValueError("a step feeds tokens from the previous step or drafts from the device, not both")
    if state_slots is not None and len(state_slots) != len(chunks):
        raise ValueError(f"{len(state_slots)} state slots for {len(chunks)} chunks")
    states = (np.full(len(chunks), NULL_SLOT, dtype=np.int32) if state_slots is None
              else np.asarray(state_slots, dtype=np.int32))
    state_slot_epochs = None if state_slots is None else np.array(
        [c.state_slot.epoch if c.state_slot is not None else 0 for c in chunks], dtype=np.int64)
    keeps = None
    if any(c.keep_slots for c in chunks):
        keeps = np.full(len(input_ids), -1, dtype=np.int32)
        for i, chunk in enumerate(chunks):
            if chunk.keep_slots:
                if len(chunk.keep_slots) != len(chunk.token_ids):
                    raise ValueError(f"chunk {i}: {len(chunk.keep_slots)} keep slots for {len(chunk.token_ids)} tokens")
                keeps[int(qsl[i]):int(qsl[i]) + len(chunk.token_ids)] = chunk.keep_slots
    forward = ForwardBatch(input_ids, positions, slots, qsl, seq_lens, tables, np.asarray(logits, dtype=np.int64),
                           np.asarray(targets, dtype=np.int64), np.asarray(sources, dtype=np.int64), states, keeps)
    return StepPlan(forward, tuple(rows), transfers, state_slot_epochs, slot_changes, fed_tokens)
