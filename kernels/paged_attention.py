"""Paged attention over the block KV cache: torch reference.

Layout: ``kv_cache_layer`` is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V); the
keys of sequence b at position p live at slot ``block_tables[b, p // block_size] * block_size + p % block_size``.
Query ``[T, H, D]`` holds the step's new tokens concatenated by sequence (``meta.query_start_loc``); the new
tokens of sequence b sit at positions ``seq_lens[b] - q_len .. seq_lens[b] - 1`` and a token at position p
attends to cached keys ``0..p``. GQA: ``H = KVH * group``, query head h reads KV head ``h // group``.
Softmax and accumulation run in float32; the output has the query's dtype. An fp8 cache is read dequantized
(``kernels/fp8.py``: each gathered K and V times the layer's ``k_scale`` / ``v_scale``) by every path alike.

Entry points (a Triton kernel with the same signature can sit beside each):
  - ``paged_attention_ref``: dispatch on ``meta.is_decode_only``;
  - ``paged_decode_attention_ref``: decode-only batch, padded to ``max_seq_len``, one batched masked computation;
  - ``paged_prefill_attention_ref``: any varlen batch (prefill, chunked prefill, mixed): the single-token
    sequences of the step go through the batched decode computation, the others one sequence at a time.

``plan_paged_attention(meta, block_size)`` builds the gather indices and masks once per step; pass the plan to
every layer's call (it is rebuilt per call when omitted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.fp8 import dequantize_kv_ref, is_fp8


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with a single new token, attended together: keys gathered padded to ``max_len``."""

    rows: torch.Tensor | None  # [Bd] int64 token rows of the step (None: every row, in order)
    max_len: int  # Ld = the longest context in the group
    gather_slots: torch.Tensor  # [Bd * Ld] int64 slots of positions 0..Ld-1 (padding -> a valid slot)
    attend_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] bool, True where p < seq_len; None when none is padded


@dataclass(slots=True)
class PagedAttentionPlan:
    """Gather indices and masks derived from one step's metadata; shared by all layers of the step."""

    block_size: int
    is_decode_only: bool
    decode: DecodeGroup | None = None
    # multi-token sequences: batch index, slots of positions 0..S_b-1, and the [q_len, S_b] bool mask
    # (True = attend) of a chunk after a cached prefix (None when the whole context is new: plain causal)
    seq_index: list[int] = field(default_factory=list)
    seq_slots: list[torch.Tensor] = field(default_factory=list)
    attend_masks: list[torch.Tensor | None] = field(default_factory=list)


def _positions_to_slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[B, length] int64 slots of positions 0..length-1 through each block table."""
    pos = torch.arange(length, device=block_tables.device)
    blocks = block_tables.index_select(1, pos // block_size).to(torch.int64)
    return blocks * block_size + (pos % block_size)


def _decode_group(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, seq_lens_host: list[int], block_size: int, rows
) -> DecodeGroup:
    L = max(seq_lens_host)
    slots = _positions_to_slots(block_tables, L, block_size)
    attend = None
    if any(s != L for s in seq_lens_host):
        pos = torch.arange(L, device=slots.device)
        attend = (pos[None, :] < seq_lens[:, None].to(torch.int64)).view(len(seq_lens_host), 1, 1, L)
    return DecodeGroup(rows, L, slots.reshape(-1), attend)


def plan_paged_attention(meta, block_size: int) -> PagedAttentionPlan:
    """Build the step's gather indices and masks (once per step; no device sync)."""
    B = len(meta.seq_lens_host)
    tables = meta.block_tables[:B]
    if meta.is_decode_only:
        group = _decode_group(tables, meta.seq_lens, meta.seq_lens_host, block_size, None)
        return PagedAttentionPlan(block_size, True, decode=group)
    qsl = meta.query_start_loc_host
    plan = PagedAttentionPlan(block_size, False)
    single = [b for b in range(B) if qsl[b + 1] - qsl[b] == 1]
    if single:
        device = meta.seq_lens.device
        idx = torch.tensor(single, dtype=torch.int64, device=device)
        rows = torch.tensor([qsl[b] for b in single], dtype=torch.int64, device=device)
        plan.decode = _decode_group(
            tables.index_select(0, idx),
            meta.seq_lens.index_select(0, idx),
            [meta.seq_lens_host[b] for b in single],
            block_size,
            rows,
        )
    multi = [b for b in range(B) if qsl[b + 1] - qsl[b] > 1]
    if multi:
        slots = _positions_to_slots(tables, max(meta.seq_lens_host[b] for b in multi), block_size)
        for b in multi:
            S = meta.seq_lens_host[b]
            ql = qsl[b + 1] - qsl[b]
            plan.seq_index.append(b)
            plan.seq_slots.append(slots[b, :S])
            if ql == S:
                plan.attend_masks.append(None)
            else:
                i = torch.arange(ql, device=slots.device)[:, None]
                j = torch.arange(S, device=slots.device)[None, :]
                plan.attend_masks.append(j <= i + (S - ql))
    return plan


def paged_attention_ref(
    query: torch.Tensor,  # [T, H, D]
    kv_cache_layer: torch.Tensor,  # [2, NB, BS, KVH, D]
    meta,  # AttentionMetadata
    scale: float,
    plan: PagedAttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D]
    """``k_scale`` / ``v_scale``: the layer's fp8 cache scales (unused for a cache of another dtype)."""
    if meta.is_decode_only:
        return paged_decode_attention_ref(query, kv_cache_layer, meta, scale, plan, k_scale, v_scale)
    return paged_prefill_attention_ref(query, kv_cache_layer, meta, scale, plan, k_scale, v_scale)


def _gathered_kv(kv: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float) -> torch.Tensor:
    """Gathered cache rows [2, ...] in ``dtype``: an fp8 cache's dequantized with the layer's scales."""
    if not is_fp8(kv.dtype):
        return kv.to(dtype)
    return torch.stack([dequantize_kv_ref(kv[0], k_scale, dtype), dequantize_kv_ref(kv[1], v_scale, dtype)])


def _attend_decode_group(query: torch.Tensor, kv_cache_layer: torch.Tensor, group: DecodeGroup, scale: float,
                         k_scale: float = 1.0, v_scale: float = 1.0):
    """query [Bd, H, D], one token per sequence at its last position -> [Bd, H, D]. Inputs are upcast to
    float32, so scores, softmax and the weighted sum run in float32."""
    _, nb, bs, kvh, d = kv_cache_layer.shape
    B, H, _ = query.shape
    L = group.max_len
    kv = kv_cache_layer.view(2, nb * bs, kvh * d).index_select(1, group.gather_slots)
    kv = _gathered_kv(kv.view(2, B, L, kvh, d).transpose(2, 3), torch.float32, k_scale, v_scale)  # [2, B, KVH, L, D]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2).float(),  # [B, H, 1, D]
        kv[0],
        kv[1],
        attn_mask=group.attend_mask,
        scale=scale,
        enable_gqa=H != kvh,
    )  # [B, H, 1, D]
    return out.view(B, H, d).to(query.dtype)


def paged_decode_attention_ref(
    query: torch.Tensor,  # [B, H, D], one new token per sequence
    kv_cache_layer: torch.Tensor,
    meta,
    scale: float,
    plan: PagedAttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [B, H, D]
    """Decode-only batch: gather every sequence's keys padded to max_seq_len; one masked batched attention."""
    if plan is None or not plan.is_decode_only:
        plan = plan_paged_attention(meta, kv_cache_layer.shape[2])
    return _attend_decode_group(query, kv_cache_layer, plan.decode, scale, k_scale, v_scale)


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [T, H, D]
    kv_cache_layer: torch.Tensor,
    meta,
    scale: float,
    plan: PagedAttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D]
    """Any varlen batch (prefill chunks after a cached prefix, decode tokens mixed in).

    Single-token sequences go through the batched decode computation; each multi-token sequence gathers its keys
    through its block table and runs torch's fused scaled_dot_product_attention (float32 accumulation and
    softmax for bf16 inputs): plain causal when its whole context is new, a causal-with-offset mask after a
    cached prefix.
    """
    _, nb, bs, kvh, d = kv_cache_layer.shape
    if plan is None or plan.is_decode_only:
        plan = plan_paged_attention(_as_varlen(meta), bs)
    T, H, _ = query.shape
    out = torch.empty(T, H, d, dtype=query.dtype, device=query.device)
    group = plan.decode
    if group is not None:  # rows is set: a varlen plan names the single-token rows
        out.index_copy_(0, group.rows, _attend_decode_group(query.index_select(0, group.rows), kv_cache_layer,
                                                             group, scale, k_scale, v_scale))
    flat = kv_cache_layer.view(2, nb * bs, kvh * d)
    qsl = meta.query_start_loc_host
    for b, slots, mask in zip(plan.seq_index, plan.seq_slots, plan.attend_masks):
        q0, q1 = qsl[b], qsl[b + 1]
        S = slots.shape[0]
        kv = _gathered_kv(flat.index_select(1, slots).view(2, S, kvh, d).transpose(1, 2), query.dtype, k_scale,
                          v_scale)  # [2, KVH, S, D]
        o = F.scaled_dot_product_attention(
            query[q0:q1].transpose(0, 1).unsqueeze(0),  # [1, H, ql, D]
            kv[0].unsqueeze(0),
            kv[1].unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=H != kvh,
        )  # [1, H, ql, D]
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def _as_varlen(meta):
    """The metadata viewed as a general varlen batch (so the varlen path can plan a decode-only batch too)."""
    if not meta.is_decode_only:
        return meta
    from copy import copy

    m = copy(meta)
    m.is_decode_only = False
    return m
