"""Paged attention over the block KV cache: torch reference.

Layout: ``kv_cache_layer`` is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V); the
keys of sequence b at position p live at slot ``block_tables[b, p // block_size] * block_size + p % block_size``.
Query ``[T, H, D]`` holds the step's new tokens concatenated by sequence (``meta.query_start_loc``); the new
tokens of sequence b sit at positions ``seq_lens[b] - q_len .. seq_lens[b] - 1`` and a token at position p
attends to cached keys ``0..p``. GQA: ``H = KVH * group``, query head h reads KV head ``h // group``.
Scores, softmax and the weighted sum run in float32; the output has the query's dtype.

Entry points (a Triton kernel with the same signature can sit beside each):
  - ``paged_attention_ref``: dispatch on ``meta.is_decode_only``;
  - ``paged_decode_attention_ref``: decode-only batch, padded to ``max_seq_len``, one batched masked computation;
  - ``paged_prefill_attention_ref``: any varlen batch (prefill, chunked prefill, mixed), per sequence.

``plan_paged_attention(meta, block_size)`` builds the gather indices and masks once per step; pass the plan to
every layer's call (it is rebuilt per call when omitted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Bound on the fp32 score tile [H, q_tile, S] of the per-sequence path (elements).
_SCORE_TILE_ELEMS = 1 << 24


@dataclass(slots=True)
class PagedAttentionPlan:
    """Gather indices and masks derived from one step's metadata; shared by all layers of the step."""

    block_size: int
    is_decode_only: bool
    # decode-only: slots of positions 0..max_seq_len-1 of every sequence, flattened [B * L] (padding -> a valid slot)
    gather_slots: torch.Tensor | None = None
    # decode-only: [B, 1, 1, L] bool, True at padding (p >= seq_len); None when no sequence is padded
    pad_mask: torch.Tensor | None = None
    # per-sequence path: slots of positions 0..S_b-1 per sequence, and [q_len, S_b] bool masks (True = masked)
    seq_slots: list[torch.Tensor] | None = None
    causal_masks: list[torch.Tensor | None] | None = None


def _positions_to_slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[B, length] int64 slots of positions 0..length-1 through each block table."""
    pos = torch.arange(length, device=block_tables.device)
    blocks = block_tables.index_select(1, pos // block_size).to(torch.int64)
    return blocks * block_size + (pos % block_size)


def plan_paged_attention(meta, block_size: int) -> PagedAttentionPlan:
    """Build the step's gather indices and masks (once per step; no device sync)."""
    B = len(meta.seq_lens_host)
    L = meta.max_seq_len
    slots = _positions_to_slots(meta.block_tables[:B], L, block_size)  # [B, L]
    if meta.is_decode_only:
        pad_mask = None
        if any(s != L for s in meta.seq_lens_host):
            pos = torch.arange(L, device=slots.device)
            pad_mask = (pos[None, :] >= meta.seq_lens[:, None].to(torch.int64)).view(B, 1, 1, L)
        return PagedAttentionPlan(block_size, True, gather_slots=slots.reshape(-1), pad_mask=pad_mask)
    qsl = meta.query_start_loc_host
    seq_slots: list[torch.Tensor] = []
    masks: list[torch.Tensor | None] = []
    for b in range(B):
        S = meta.seq_lens_host[b]
        ql = qsl[b + 1] - qsl[b]
        seq_slots.append(slots[b, :S])
        if ql <= 1:
            masks.append(None)  # a single (last) query sees every cached key
        else:
            i = torch.arange(ql, device=slots.device)[:, None]
            j = torch.arange(S, device=slots.device)[None, :]
            masks.append(j > i + (S - ql))
    return PagedAttentionPlan(block_size, False, seq_slots=seq_slots, causal_masks=masks)


def paged_attention_ref(
    query: torch.Tensor,  # [T, H, D]
    kv_cache_layer: torch.Tensor,  # [2, NB, BS, KVH, D]
    meta,  # AttentionMetadata
    scale: float,
    plan: PagedAttentionPlan | None = None,
) -> torch.Tensor:  # [T, H, D]
    if meta.is_decode_only:
        return paged_decode_attention_ref(query, kv_cache_layer, meta, scale, plan)
    return paged_prefill_attention_ref(query, kv_cache_layer, meta, scale, plan)


def paged_decode_attention_ref(
    query: torch.Tensor,  # [B, H, D], one new token per sequence
    kv_cache_layer: torch.Tensor,
    meta,
    scale: float,
    plan: PagedAttentionPlan | None = None,
) -> torch.Tensor:  # [B, H, D]
    """Decode-only batch: gather every sequence's keys padded to max_seq_len; one masked batched attention."""
    _, nb, bs, kvh, d = kv_cache_layer.shape
    if plan is None or not plan.is_decode_only:
        plan = plan_paged_attention(meta, bs)
    B, H, _ = query.shape
    L = meta.max_seq_len
    g = H // kvh
    kv = kv_cache_layer.view(2, nb * bs, kvh * d).index_select(1, plan.gather_slots).view(2, B, L, kvh, d)
    k = kv[0].permute(0, 2, 3, 1).float()  # [B, KVH, D, L]
    v = kv[1].transpose(1, 2).float()  # [B, KVH, L, D]
    q = query.reshape(B, kvh, g, d).float()
    scores = torch.matmul(q, k).mul_(scale)  # [B, KVH, G, L]
    if plan.pad_mask is not None:
        scores.masked_fill_(plan.pad_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [B, KVH, G, D]
    return out.view(B, H, d).to(query.dtype)


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [T, H, D]
    kv_cache_layer: torch.Tensor,
    meta,
    scale: float,
    plan: PagedAttentionPlan | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Any varlen batch (prefill chunks with a cached prefix, decode tokens mixed in): one sequence at a time."""
    _, nb, bs, kvh, d = kv_cache_layer.shape
    if plan is None or plan.seq_slots is None:
        plan = plan_paged_attention(_as_varlen(meta), bs)
    T, H, _ = query.shape
    g = H // kvh
    flat = kv_cache_layer.view(2, nb * bs, kvh * d)
    out = torch.empty(T, H, d, dtype=query.dtype, device=query.device)
    qsl = meta.query_start_loc_host
    for b, S in enumerate(meta.seq_lens_host):
        q0, q1 = qsl[b], qsl[b + 1]
        ql = q1 - q0
        if ql == 0:
            continue
        kv = flat.index_select(1, plan.seq_slots[b]).view(2, S, kvh, d)
        k = kv[0].permute(1, 2, 0).unsqueeze(1).float()  # [KVH, 1, D, S]
        v = kv[1].transpose(0, 1).unsqueeze(1).float()  # [KVH, 1, S, D]
        mask = plan.causal_masks[b]
        tile = max(1, _SCORE_TILE_ELEMS // (H * S))
        for t0 in range(0, ql, tile):
            t1 = min(ql, t0 + tile)
            q = query[q0 + t0 : q0 + t1].view(t1 - t0, kvh, g, d).permute(1, 2, 0, 3).float()  # [KVH, G, q, D]
            scores = torch.matmul(q, k).mul_(scale)  # [KVH, G, q, S]
            if mask is not None:
                scores.masked_fill_(mask[t0:t1], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs, v)  # [KVH, G, q, D]
            out[q0 + t0 : q0 + t1] = o.permute(2, 0, 1, 3).reshape(t1 - t0, H, d)
    return out


def _as_varlen(meta):
    """The metadata viewed as a general varlen batch (so the per-sequence path can plan a decode batch too)."""
    if not meta.is_decode_only:
        return meta
    from copy import copy

    m = copy(meta)
    m.is_decode_only = False
    return m
