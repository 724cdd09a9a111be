"""Per-step attention metadata shared by every attention layer of one forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """One step's varlen batch: B sequences, T new tokens in total, concatenated in order."""

    slot_mapping: torch.Tensor  # [T] int64: KV slot where each new token's K/V is written
    query_start_loc: torch.Tensor  # [B+1] int32: cumulative new-token counts (sequence b owns tokens qsl[b]:qsl[b+1])
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence INCLUDING this step's new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each sequence's blocks
    query_start_loc_host: list[int]  # host copies, so CPU loops never sync
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool  # every sequence has exactly one new token
    kernel_plan: object | None = None  # fixed GPU launch choices (CUDA graphs need a fixed grid); None: heuristics

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str | None = None,
) -> AttentionMetadata:
    """Build metadata on the host from plain lists (tests, simple runners).

    query_lens[b] new tokens of sequence b sit at positions seq_lens[b]-query_lens[b] .. seq_lens[b]-1;
    block_tables[b] lists the sequence's KV block ids in order (it must cover seq_lens[b] tokens).
    """
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    if not query_lens:
        raise ValueError("empty batch")
    qsl = [0]
    slots: list[int] = []
    for q, s, bt in zip(query_lens, seq_lens, block_tables):
        if q < 1 or q > s:
            raise ValueError(f"need 1 <= query_len <= seq_len, got query_len={q}, seq_len={s}")
        if len(bt) * block_size < s:
            raise ValueError(f"block table of {len(bt)} blocks cannot hold {s} tokens (block_size {block_size})")
        qsl.append(qsl[-1] + q)
        for p in range(s - q, s):
            slots.append(bt[p // block_size] * block_size + p % block_size)
    max_blocks = max(1, max(len(bt) for bt in block_tables))
    table = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
    for b, bt in enumerate(block_tables):
        if bt:
            table[b, : len(bt)] = torch.tensor(list(bt), dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=table.to(device) if device is not None else table,
        query_start_loc_host=qsl,
        seq_lens_host=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        is_decode_only=all(q == 1 for q in query_lens),
    )
