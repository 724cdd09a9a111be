"""Decode attention over the paged cache (one new token per sequence): flash-decoding in Triton, same contract
as ``kernels.paged_attention`` for decode-only steps.

Grid ``(B, KVH, num_splits)``; the query heads of a KV head are the rows of the Q tile (padded to 16 for
``tl.dot``). Each sequence's context is cut on the device into ``num_splits`` equal parts (rounded up to BLOCK_N),
each part writes a normalized partial output and its log-sum-exp, and a small reduce kernel combines them.
``decode_num_splits`` picks the count from the batch shape; with one split the kernel writes the output directly
and no reduce runs. The key tile step, the output gate and the plan are
shared with the prefill kernel (``kernels/triton_paged_attention.py``).

``paged_rows_attention_triton`` runs the same kernel over the tokens of speculative-decoding verify rows (up to 16
new tokens a sequence): each token is one decode "pseudo-row" whose context ends at its own position, so it gets
the bitwise result plain decoding gives that token as a one-token row under the same plan (same splits, tiles and
reduce), and greedy output with speculation equals greedy output without it. The prefill kernel, which would
otherwise serve these rows, sums in another order.

An fp8 cache is read as in the prefill kernel (``KV_FP8``: tiles in the query's dtype, ``k_scale`` in the score
factor, ``v_scale`` on each split's output), in both the plain and the rows launch, so verify rows keep plain
decoding's bits with an fp8 cache too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton_compat import pdl_launch, pdl_wait
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl
from kernels.triton_fp8_kv import is_fp8_kv, read_scales
from kernels.triton_paged_attention import (TritonAttentionPlan, attend_tile, block_pow2, check_query, dtype_choices,
                                            num_sms_of, output_gate, score_scale)

MIN_SPLIT_TOKENS = 256  # a decode split below this many keys costs more in partial writes + reduce than it saves
# The most splits of one row: a long context with 2 KV heads (Qwen3.5-35B-A3B) at batch 1 needs about this many for
# WAVES programs an SM.
MAX_SPLITS = 128
WAVES = 2  # decode aims at this many programs per SM
# The reduce (``_decode_reduce_kernel``) reads which splits hold keys from the row's length before its wait, and
# loads the partials' outputs with their log-sum-exps instead of after them: an early read (kernels/triton_compat).
# A split with no keys then loads and stores nothing (at batch 1 most of a graph's splits are empty: they are sized
# for the longest context).
SKIP_EMPTY_SPLITS = True
# A row using at most this many splits is combined from a [16, head_dim] tile (``_decode_reduce_kernel``), where a
# graph sized for the longest context would load one of all its splits.
REDUCE_SHORT_SPLITS = 16
# Keys a tile of the split kernel for head dims up to 128 (a plan may set another): a smaller tile saves a little at
# short contexts and loses far more at long ones (bench/results/b1-decode-block-n-*.json).
DECODE_BLOCK_N = 64


@_jit
def decode_split_len(seq_len, num_splits, tile):
    """Keys a decode split of a row of ``seq_len`` keys holds: equal parts rounded up to whole ``tile``s. The split
    kernel partitions by it, and the reduce derives from it which splits hold keys: one rule for both."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), tile) * tile


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Splits per sequence: enough (sequence, KV head, split) programs for WAVES waves over the SMs, but no split
    under MIN_SPLIT_TOKENS keys; 1 (no reduce kernel) when B * KVH already fills the GPU or contexts are short."""
    want = -(-WAVES * num_sms // max(1, num_seqs * num_kv_heads))
    cap = -(-max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(want, cap, MAX_SPLITS))


@_jit(do_not_specialize=['num_splits', 'stride_bt'])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_lse_ptr, gate_ptr,
    qk_scale, v_scale, num_splits,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ob, stride_oh, stride_gb, stride_gh,
    row_seq_ptr, new_from_ptr,  # ROWS only (last: the plain kernel's other arguments keep their places)
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr = False,
    ROWS: tl.constexpr = False, SKIP_EMPTY: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,
):
    """Program (b, kvh, split): one split of row b's keys for the query heads of KV head kvh.

    Plain decode (``ROWS`` False): row b is sequence b, its context ``seq_lens[b]`` keys, its one new key the last
    (``row_seq_ptr`` and ``new_from_ptr`` unused). ``ROWS`` (``paged_rows_attention_triton``): row b is token b of
    the step, ``seq_lens_ptr`` holds each token's own context length (its position + 1), ``row_seq_ptr`` its
    sequence (the block-table row) and ``new_from_ptr`` the first position the step writes in that sequence; every
    key from there on is this step's, read only after the wait. Nothing else differs: the same tiles and
    operations, so a token's output is bitwise the one a one-token decode row at its position gets. ``KV_FP8``: the
    cache holds e4m3; ``qk_scale`` carries k_scale and each split's output is scaled by ``v_scale``."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    seq = tl.load(row_seq_ptr + b) if ROWS else b  # the block-table row
    split_len = decode_split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, G_PAD)
    dims = tl.arange(0, D_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kvh * GROUP + rows
    q_mask = row_ok[:, None] & dim_ok[None, :]
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_kh

    # The split's first key tile. Every key but the step's own (positions new_from .. seq_len - 1, which the
    # prologue kernel writes; plain decode: seq_len - 1 alone) was written by an earlier step, and the block table,
    # lengths and rows arrays by host copies or kernels finished before this step's chain (triton_compat): all of
    # it may be read before the wait, overlapping the kernels this one waits on.
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
    kv_off = (blk.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt)[:, None] + dims[None, :]
    new_from = tl.load(new_from_ptr + b) if ROWS else seq_len - 1  # the first key this step writes
    old = (n_ok & (offs_n < new_from))[:, None] & dim_ok[None, :]
    k = tl.load(k_base + kv_off, mask=old, other=0.0)
    v = tl.load(v_base + kv_off, mask=old, other=0.0)
    pdl_wait(PDL)  # dependent launch: kernels/triton_compat.py
    if ROWS:  # the step's keys up to the row's own, those in this tile (n_ok: below end <= seq_len)
        new = (n_ok & (offs_n >= new_from))[:, None] & dim_ok[None, :]
    else:
        new = (offs_n == seq_len - 1)[:, None] & dim_ok[None, :]  # the step's own key, if it falls in this tile
    k = tl.where(new, tl.load(k_base + kv_off, mask=new, other=0.0), k)
    v = tl.where(new, tl.load(v_base + kv_off, mask=new, other=0.0), v)
    # SKIP_EMPTY (the reduce derives the used splits from the length): a split past the row's keys reads no query
    # and writes no partials
    live = (start < seq_len) | (not SKIP_EMPTY)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask & live, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    elif not KV_FP8:  # an fp8 cache's tiles take the query's dtype instead
        q = q.to(k_ptr.dtype.element_ty)
    k = k.to(q.dtype)  # fp32, or e4m3 values exactly, or a no-op (attend_tile converts the later tiles alike)
    v = v.to(q.dtype)

    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    if start < end:  # an empty split (start >= seq_len) has no tile
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_i = tl.max(s, 1)
        p = tl.exp2(s - m_i[:, None])
        l_i = tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    for i in range(1, tl.cdiv(end - start, BLOCK_N)):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_base, v_base, bt_row, start + i * BLOCK_N, end, rows, dims, dim_ok,
            stride_kb, stride_kt, qk_scale, BLOCK_SIZE, BLOCK_N, True, False, PRECISION,
        )
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if KV_FP8:  # p @ v summed v / v_scale
        out = out * v_scale
    if DIRECT:
        if GATED:
            out = output_gate(out, gate_ptr + b * stride_gb + heads[:, None] * stride_gh + dims[None, :], q_mask,
                              out_ptr.dtype.element_ty)
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (b * GROUP * tl.num_programs(1) + heads) * num_splits + split  # [rows, H, splits] row-major
        tl.store(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], out, mask=q_mask & live)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok & live)


@_jit
def _combine_splits(part_acc_ptr, part_lse_ptr, base, used, dims, D_PAD: tl.constexpr, S: tl.constexpr):
    """The first ``used`` splits' partials from one [S, D_PAD] tile: sum_j 2^(lse_j - max) acc_j / sum_j 2^(...)."""
    splits = tl.arange(0, S)
    ok = splits < used
    lse = tl.load(part_lse_ptr + base + splits, mask=ok, other=float("-inf"))
    part = tl.load(part_acc_ptr + (base + splits)[:, None] * D_PAD + dims[None, :], mask=ok[:, None], other=0.0)
    w = tl.exp2(lse - tl.max(lse, 0))
    return tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)


@_jit(do_not_specialize=['num_splits'])
def _decode_reduce_kernel(
    part_acc_ptr, part_lse_ptr, out_ptr, gate_ptr, num_splits, stride_ob, stride_oh, stride_gb, stride_gh,
    seq_lens_ptr, split_tile,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, SHORT: tl.constexpr, GATED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Combine one (row, head)'s used KV splits, as ``split_reduce_kernel`` combines all of them.

    The used splits follow from the row's length ``seq_lens[b]`` alone (the split kernel's partition), a host copy
    read before the wait, so the log-sum-exps and the outputs are loaded together, and a row that uses at most
    SHORT splits is combined from a [SHORT, D_PAD] tile instead of the [S_PAD, D_PAD] tile of every split (a graph's
    split count is sized for the longest context). Which tile a row takes depends on its length and the split
    count alone, so its bits do too."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    dims = tl.arange(0, D_PAD)
    base = (b * tl.num_programs(1) + h) * num_splits
    seq_len = tl.load(seq_lens_ptr + b)
    used = tl.cdiv(seq_len, decode_split_len(seq_len, num_splits, split_tile))  # <= num_splits; split 0 holds key 0
    pdl_wait(PDL)  # dependent launch: kernels/triton_compat.py
    if used <= SHORT:
        out = _combine_splits(part_acc_ptr, part_lse_ptr, base, used, dims, D_PAD, SHORT)
    else:
        out = _combine_splits(part_acc_ptr, part_lse_ptr, base, used, dims, D_PAD, S_PAD)
    if GATED:
        out = output_gate(out, gate_ptr + b * stride_gb + h * stride_gh + dims, dims < HEAD_DIM,
                          out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@dataclass(slots=True)
class DecodeRows:
    """Per-token rows of a step for ``paged_rows_attention_triton``, int32 device arrays of [T] (T tokens)."""

    seq: torch.Tensor  # the token's sequence (its block-table row)
    seq_len: torch.Tensor  # its position + 1: the keys it attends to
    new_from: torch.Tensor  # the first position the step writes in its sequence: seq_lens[b] - q_b


def decode_rows(meta, num_tokens: int) -> DecodeRows:
    """The step's ``DecodeRows``, built on the device with no host sync (CUDA-graph capturable): token t belongs to
    the sequence b with ``query_start_loc[b] <= t < query_start_loc[b + 1]`` and sits at position
    ``seq_lens[b] - (query_start_loc[b + 1] - t)``. ``num_tokens`` is ``query_start_loc[-1]``, passed because
    reading it would sync. Build once a step; every attention layer reads the same. Needs q_b <= seq_lens[b] (the
    CUDA graphs' padding rows have seq_len q): a row's seq_len is at least 1."""
    qsl = meta.query_start_loc.to(torch.int32).contiguous()  # both no-ops for the pipeline's metadata
    ends = qsl[1:]
    tokens = torch.arange(num_tokens, dtype=torch.int32, device=qsl.device)
    seq = torch.searchsorted(ends, tokens, right=True, out_int32=True)
    seq_lens = meta.seq_lens.to(torch.int32)
    seq_len = (seq_lens - ends).index_select(0, seq) + tokens + 1
    new_from = (seq_lens - (ends - qsl[:-1])).index_select(0, seq)
    return DecodeRows(seq=seq, seq_len=seq_len, new_from=new_from)


def _decode_launch(query: torch.Tensor, kv_cache_layer: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, plan: TritonAttentionPlan, splits: int,
                   gate: torch.Tensor | None, rows: DecodeRows | None, kvh: int, group: int,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The split kernel over (rows of ``query``, KV heads, ``splits``), then the reduce when ``splits`` > 1: one
    launch path for plain decode (``rows`` None, row b = sequence b) and for verify rows (row b = token b)."""
    if gate is not None and (gate.shape != query.shape or gate.stride(-1) != 1):
        raise ValueError(f"gate {tuple(gate.shape)} does not fit query {tuple(query.shape)} (last dim contiguous)")
    R, H, d = query.shape
    d_pad = block_pow2(d)
    block_n = block_pow2(plan.decode_block_n or (DECODE_BLOCK_N if d_pad <= 128 else 32))  # tl.dot needs >= 16
    out = torch.empty_like(query)
    direct = splits == 1
    part_acc = query.new_empty(0 if direct else R * H * splits * d_pad, dtype=torch.float32)
    part_lse = query.new_empty(0 if direct else R * H * splits, dtype=torch.float32)
    fp32, precision = dtype_choices(kv_cache_layer, query)
    k_scale, v_scale = read_scales(kv_cache_layer, k_scale, v_scale)
    k, v = kv_cache_layer[0], kv_cache_layer[1]
    g, g_strides = (gate, (gate.stride(0), gate.stride(1))) if gate is not None else (out, (0, 0))
    row_seq, new_from = (rows.seq, rows.new_from) if rows is not None else (seq_lens, seq_lens)  # unused: plain
    _decode_split_kernel[(R, kvh, splits)](
        query, k, v, block_tables, seq_lens, out, part_acc, part_lse, g, score_scale(scale, k_scale), v_scale, splits,
        query.stride(0), query.stride(1), k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), *g_strides, row_seq, new_from,
        HEAD_DIM=d, D_PAD=d_pad, GROUP=group, G_PAD=block_pow2(group), BLOCK_SIZE=kv_cache_layer.shape[2],
        BLOCK_N=block_n, DIRECT=direct, DOT_FP32=fp32, PRECISION=precision, GATED=gate is not None, num_warps=4,
        num_stages=2, ROWS=rows is not None, SKIP_EMPTY=not direct and SKIP_EMPTY_SPLITS,
        KV_FP8=is_fp8_kv(kv_cache_layer),
        **pdl_launch(query),
    )
    if not direct:
        s_pad = block_pow2(splits, 2)
        reduce_args = (part_acc, part_lse, out, g, splits, out.stride(0), out.stride(1), *g_strides)
        _decode_reduce_kernel[(R, H)](
            *reduce_args, seq_lens, block_n, HEAD_DIM=d, D_PAD=d_pad, S_PAD=s_pad,
            SHORT=min(REDUCE_SHORT_SPLITS, s_pad), GATED=gate is not None,
            num_warps=8 if s_pad * d_pad > 16384 else 4,  # the partials tile: <= 128 fp32 a thread
            **pdl_launch(query))
    return out


def paged_decode_attention_triton(
    query: torch.Tensor,  # [B, H, D], one new token per sequence
    kv_cache_layer: torch.Tensor,  # [2, NB, BS, KVH, D]
    meta,
    scale: float,
    plan: TritonAttentionPlan | None = None,
    gate: torch.Tensor | None = None,  # [B, H, D], last dim contiguous
    k_scale: float = 1.0,  # an fp8 cache's scales (the layer's; unused for other caches)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [B, H, D]
    """Decode-only batch, split-KV (flash-decoding) with a reduce kernel when there is more than one split.
    ``gate``: the output is ``out * sigmoid(gate)`` (``output_gate``), applied where the output is stored."""
    query, kvh, group, _ = check_query(query, kv_cache_layer)
    plan = plan if isinstance(plan, TritonAttentionPlan) else TritonAttentionPlan()
    splits = plan.num_splits or decode_num_splits(query.shape[0], kvh, meta.max_seq_len, num_sms_of(query.device))
    return _decode_launch(query, kv_cache_layer, meta.block_tables, meta.seq_lens, scale, plan, splits, gate, None,
                          kvh, group, k_scale, v_scale)


def paged_rows_attention_triton(
    query: torch.Tensor,  # [T, H, D], the step's tokens concatenated by sequence
    kv_cache_layer: torch.Tensor,  # [2, NB, BS, KVH, D]
    meta,
    scale: float,
    plan: TritonAttentionPlan | None,
    gate: torch.Tensor | None = None,  # [T, H, D], last dim contiguous
    rows: DecodeRows | None = None,
    k_scale: float = 1.0,  # an fp8 cache's scales (the layer's; unused for other caches)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D]
    """Every token of a varlen step (speculative verify rows) as one decode row: token t of sequence b at position
    p attends to keys 0..p of b exactly as ``paged_decode_attention_triton`` attends for a one-token row with
    seq_len p + 1, so the outputs are bitwise equal under the same ``plan``. Pass the plan plain decoding takes
    (``plan.num_splits`` fixed: the pipeline's ``decode_plan``); without one the split count is the decode
    heuristic's for ``meta``'s sequences. ``rows``: ``decode_rows(meta, T)``, built once a step (built here if
    None). The causal mask is implicit: each row's keys end at its own position."""
    query, kvh, group, _ = check_query(query, kv_cache_layer)
    plan = plan if isinstance(plan, TritonAttentionPlan) else TritonAttentionPlan()
    T = query.shape[0]
    if rows is None:
        rows = decode_rows(meta, T)
    elif not (rows.seq.shape == rows.seq_len.shape == rows.new_from.shape == (T,)):
        raise ValueError(f"rows of {tuple(rows.seq.shape)} tokens do not fit query {tuple(query.shape)}")
    splits = plan.num_splits or decode_num_splits(meta.seq_lens.shape[0], kvh, meta.max_seq_len,
                                                  num_sms_of(query.device))
    return _decode_launch(query, kv_cache_layer, meta.block_tables, rows.seq_len, scale, plan, splits, gate, rows,
                          kvh, group, k_scale, v_scale)
