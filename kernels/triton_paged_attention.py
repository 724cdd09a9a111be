"""Paged attention over the block KV cache: Triton kernels, same contract as ``kernels.paged_attention``.

Both kernels walk keys through ``meta.block_tables`` in tiles of BLOCK_N positions (any block_size), score them
with ``tl.dot`` and keep an online softmax in float32 (base-2 exponent, ``scale * log2(e)`` folded in). GQA: one
program serves all ``group`` query heads of one KV head, so every K/V tile is loaded once per group.

* Decode (one new token per sequence): ``kernels/triton_decode_attention.py``.
* Varlen prefill (chunks after a cached prefix, decode tokens mixed in): grid ``(T // BLOCK_Q + B, KVH)``; a tile
  packs BLOCK_Q tokens x group heads into BLOCK_M rows. Program -> (sequence, tile) is a device-side binary search
  over ``query_start_loc`` (sequence b owns virtual tiles from ``qsl[b] // BLOCK_Q + b``; spare ones exit), so no
  host-built index travels per step and the launch depends only on (T, B): CUDA-graph friendly. Keys visible
  to every row of a tile run unmasked; only the diagonal tiles apply the causal mask. When the tiles cannot fill
  the GPU (a few tokens after a long cached prefix), the keys are split as in decode (``prefill_num_splits``) and
  ``split_reduce_kernel`` combines the partials.

``plan`` may be a ``TritonAttentionPlan`` (forced split count / tile sizes, e.g. in tests); anything else (such as
the torch reference's plan) is ignored, since the launch choices are a little host arithmetic.

An fp8 (e4m3) cache is read as the torch reference reads it, ``q * scale`` with the layer's ``k_scale`` / ``v_scale``
(``kernels/triton_fp8_kv.py``): tiles are converted to the query's dtype exactly, ``k_scale`` is folded into the score
scale and ``v_scale`` multiplies each program's output (``KV_FP8``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.triton_compat import INTERPRET  # interpreter: tl.dot on 16-bit inputs is wrong, use fp32
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import pdl_wait, tl
from kernels.triton_fp8_kv import is_fp8_kv, read_scales


LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class TritonAttentionPlan:
    """Launch choices; None takes the heuristic. Shared by all layers of a step."""

    num_splits: int | None = None  # decode KV partitions per sequence
    decode_block_n: int | None = None  # keys per decode tile
    prefill_block_m: int | None = None  # rows (tokens x group heads) per prefill tile
    prefill_block_n: int | None = None  # keys per prefill tile
    prefill_splits: int | None = None  # prefill KV partitions per tile (1: none)
    prefill_warps: int | None = None  # warps per prefill program
    prefill_stages: int | None = None  # software-pipeline stages of the prefill key loop
    # rows_as_decode (kernels/dispatch.py): the step's tokens as one-token decode rows
    # (kernels/triton_decode_attention.py DecodeRows); None: multi-token rows take the prefill kernel
    decode_rows: object | None = None


def block_pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(1, n) - 1).bit_length())


@functools.lru_cache(maxsize=8)
def num_sms_of(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H100 SXM: the target the heuristic is written for


def dtype_choices(cache: torch.Tensor, query: torch.Tensor) -> tuple[bool, str]:
    """(compute tl.dot in fp32, input precision): fp32 under the interpreter and where the tiles are fp32 (ieee, not
    tf32): an fp32 cache, or an fp8 cache under fp32 queries (fp8 tiles are converted to the query's dtype)."""
    fp32 = INTERPRET or (query.dtype if is_fp8_kv(cache) else cache.dtype) == torch.float32
    return fp32, "ieee" if fp32 else "tf32"


def score_scale(scale: float, k_scale: float) -> float:
    """The kernels' score factor: softmax ``scale`` in the base-2 domain, times an fp8 cache's ``k_scale``
    (``q . (k * k_scale) = (q . k) * k_scale``; 1 for other caches, so their factor keeps its bits)."""
    return scale * LOG2E * k_scale


@_jit
def attend_tile(
    q, acc, m_i, l_i, k_base, v_base, bt_row, n0, kv_end, pos, dims, dim_ok,
    stride_kb, stride_kt, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BOUNDED: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One online-softmax step over keys n0..n0+BLOCK_N-1 (masked to < kv_end and/or <= pos per row). K and V tiles
    are converted to q's dtype: fp32 where the dot runs in fp32, an fp8 cache's e4m3 values exactly, a no-op
    otherwise (q already has the cache's dtype)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_end
    if BOUNDED:
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
        kv_mask = n_ok[:, None] & dim_ok[None, :]
    else:
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE)
        kv_mask = dim_ok[None, :]
    kv_off = blk.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
    k = tl.load(k_base + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, BLOCK_N], log2 domain
    if BOUNDED:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite once a row has seen a key (every row, but in a KV split)
    m_ref = m_new
    if CAUSAL:  # a row that has seen no key yet (its split starts past it): nothing to rescale, nothing to add
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@_jit
def output_gate(out, gate_ptrs, mask, OUT_TY: tl.constexpr):
    """Qwen3-Next's gated attention output, rounded as torch's ``out * sigmoid(gate)`` in the activation dtype:
    the attention output and the sigmoid each rounded to it, their product in fp32."""
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    sig = (1.0 / (1.0 + tl.exp(-gate))).to(OUT_TY).to(tl.float32)
    return out.to(OUT_TY).to(tl.float32) * sig


@_jit
def find_sequence(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest b with qsl[b] // BLOCK_Q + b <= tile (binary search over the device query_start_loc): the
    sequence owning virtual tile `tile` when sequence b owns tiles from qsl[b] // BLOCK_Q + b (also used by the
    Gated DeltaNet kernels)."""
    lo = tile * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        go_right = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


@_jit(do_not_specialize=['num_seqs', 'stride_bt'])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr, part_acc_ptr, part_lse_ptr, qk_scale, v_scale,
    num_seqs, num_splits, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr = False, KV_FP8: tl.constexpr = False,
):
    """SPLIT: program (tile, KV head, split) takes the split's keys only (the sequence's length cut in num_splits
    parts of whole key tiles) and writes a normalized partial and its log-sum-exp, as the decode splits do.
    KV_FP8: the cache holds e4m3 (``qk_scale`` carries k_scale; the output is scaled by ``v_scale``)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = find_sequence(qsl_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_begin
    tok0 = (tile - (q_begin // BLOCK_Q + b)) * BLOCK_Q  # first token of the tile, within the sequence
    if tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # cached prefix: token t sits at position ctx + t

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D_PAD)
    tok = tok0 + rows // GROUP  # row = token * GROUP + head-in-group
    heads = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dim_ok = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q_off = (q_begin + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    elif not KV_FP8:  # an fp8 cache's tiles take the query's dtype instead
        q = q.to(k_ptr.dtype.element_ty)
    pos = ctx + tok

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_kh
    kv_end = ctx + tl.minimum(tok0 + BLOCK_Q, q_len)  # one past the tile's last position
    full = (ctx + tok0 + 1) // BLOCK_N  # tiles of keys every row of the tile may see
    lo = 0
    hi = tl.cdiv(kv_end, BLOCK_N)
    if SPLIT:
        split = tl.program_id(2)
        split_tiles = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N)
        lo = split * split_tiles
        hi = tl.minimum(hi, lo + split_tiles)
    for i in range(lo, tl.minimum(full, hi)):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_base, v_base, bt_row, i * BLOCK_N, kv_end, pos, dims, dim_ok,
            stride_kb, stride_kt, qk_scale, BLOCK_SIZE, BLOCK_N, False, False, PRECISION,
        )
    for i in range(tl.maximum(full, lo), hi):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_base, v_base, bt_row, i * BLOCK_N, kv_end, pos, dims, dim_ok,
            stride_kb, stride_kt, qk_scale, BLOCK_SIZE, BLOCK_N, True, True, PRECISION,
        )
    if KV_FP8:  # p @ v summed v / v_scale
        acc = acc * v_scale
    if SPLIT:  # [T, H, splits] row-major, as split_reduce reads them (empty partials: lse -inf, weight 0)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        part = ((q_begin + tok) * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], acc / l_safe[:, None], mask=q_mask)
        tl.store(part_lse_ptr + part, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)
    else:
        out = acc / l_i[:, None]
        o_off = (q_begin + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@_jit(do_not_specialize=['num_splits'])
def split_reduce_kernel(
    part_acc_ptr, part_lse_ptr, out_ptr, gate_ptr, num_splits, stride_ob, stride_oh, stride_gb, stride_gh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr = False,
):
    """Combine one (row, head)'s KV-split partials (decode: a sequence; prefill: a token): weights 2^(lse_j - max
    lse); empty splits weigh 0. Split 0 is never empty (it holds key 0, which every row sees). (Decode with early
    reads combines in ``kernels/triton_decode_attention.py``'s chunked reduce instead.)"""
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, S_PAD)
    dims = tl.arange(0, D_PAD)
    base = (b * tl.num_programs(1) + h) * num_splits
    pdl_wait(PDL)  # dependent launch: kernels/triton_compat.py
    lse = tl.load(part_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    used = lse > float("-inf")
    acc = tl.load(part_acc_ptr + (base + splits)[:, None] * D_PAD + dims[None, :], mask=used[:, None], other=0.0)
    w = tl.exp2(lse - tl.max(lse, 0))
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w, 0)
    if GATED:
        out = output_gate(out, gate_ptr + b * stride_gb + h * stride_gh + dims, dims < HEAD_DIM,
                          out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def check_query(query: torch.Tensor, kv_cache_layer: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    _, _, _, kvh, d = kv_cache_layer.shape
    if query.shape[-1] != d or query.shape[1] % kvh or d > 256:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(kv_cache_layer.shape)}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    return query, kvh, query.shape[1] // kvh, d


def prefill_tile_sizes(head_dim: int, group: int, plan: TritonAttentionPlan | None = None,
                       fp32: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps). 16-bit: 128 x 128 up to head_dim 128, 128 x 64 for 256, the fastest
    over a long cached context (``bench/prefill_attention_sweep.py --compare``). fp32 tiles take twice the shared
    memory: 128 x 64, and 64 x 32 for 256."""
    d_pad = block_pow2(head_dim)
    default_m, default_n = {(False, True): (128, 128), (False, False): (128, 64),
                            (True, True): (128, 64), (True, False): (64, 32)}[(fp32, d_pad <= 128)]
    block_m = (plan and plan.prefill_block_m) or default_m
    block_n = (plan and plan.prefill_block_n) or default_n
    warps = (plan and plan.prefill_warps) or (4 if d_pad <= 64 else 8)
    return max(block_pow2(block_m), block_pow2(group)), block_pow2(block_n), warps  # powers of two, >= 16 for tl.dot


def paged_prefill_attention_triton(
    query: torch.Tensor,  # [T, H, D]
    kv_cache_layer: torch.Tensor,
    meta,
    scale: float,
    plan: TritonAttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D]
    """Any varlen batch: causal attention of each sequence's new tokens over its cached keys 0..p. ``k_scale`` /
    ``v_scale``: an fp8 cache's (the layer's; unused for other caches)."""
    query, kvh, group, d = check_query(query, kv_cache_layer)
    plan = plan if isinstance(plan, TritonAttentionPlan) else None
    T, B = query.shape[0], meta.num_seqs
    k_scale, v_scale = read_scales(kv_cache_layer, k_scale, v_scale)
    fp32, precision = dtype_choices(kv_cache_layer, query)
    block_m, block_n, warps = prefill_tile_sizes(d, group, plan, fp32)
    block_q = block_m // group
    out = torch.empty_like(query)
    k, v = kv_cache_layer[0], kv_cache_layer[1]
    tiles, d_pad = T // block_q + B, block_pow2(d)
    splits = (plan and plan.prefill_splits) or prefill_num_splits(tiles * kvh, meta.max_seq_len,
                                                                   num_sms_of(query.device))
    part_acc = query.new_empty(T * query.shape[1] * splits * d_pad if splits > 1 else 0, dtype=torch.float32)
    part_lse = query.new_empty(T * query.shape[1] * splits if splits > 1 else 0, dtype=torch.float32)
    _prefill_kernel[(tiles, kvh, splits)](
        query, k, v, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, part_acc, part_lse,
        score_scale(scale, k_scale), v_scale, B, splits,
        query.stride(0), query.stride(1), k.stride(0), k.stride(1), k.stride(2), meta.block_tables.stride(0),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, D_PAD=d_pad, GROUP=group, BLOCK_SIZE=kv_cache_layer.shape[2],
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, DOT_FP32=fp32, PRECISION=precision, SPLIT=splits > 1,
        KV_FP8=is_fp8_kv(kv_cache_layer), num_warps=warps,
        num_stages=(plan and plan.prefill_stages) or prefill_stages(d, fp32, is_fp8_kv(kv_cache_layer)),
    )
    if splits > 1:
        s_pad = block_pow2(max(splits, PREFILL_MAX_SPLITS), 2)  # one compiled variant whatever the count
        split_reduce_kernel[(T, query.shape[1])](
            part_acc, part_lse, out, out, splits, out.stride(0), out.stride(1), 0, 0,
            HEAD_DIM=d, D_PAD=d_pad, S_PAD=s_pad, GATED=False, num_warps=8 if s_pad * d_pad > 16384 else 4)
    return out


def prefill_stages(head_dim: int, fp32: bool, fp8_kv: bool) -> int:
    """Software-pipeline stages of the prefill key loop: 3, but 2 for head_dim 256 where the tiles are fp32 or come
    from an fp8 cache (each converted K/V tile takes shared memory beside the staged fp8 ones)."""
    return 3 if head_dim <= 128 or not (fp32 or fp8_kv) else 2


PREFILL_SPLIT_KEYS = 1024  # a prefill KV split below this many keys costs more in partials + reduce than it saves
PREFILL_MAX_SPLITS = 32
PREFILL_WAVE_SPLITS = 4  # at most this many splits to even out the last wave of a launch that fills the GPU


def prefill_num_splits(programs: int, max_seq_len: int, num_sms: int) -> int:
    """KV splits for a prefill launch of ``programs`` (tile, KV head) programs. A few short chunks over long
    contexts (a prompt's last tokens after a cached prefix) leave most SMs idle, each program walking every key:
    splitting the keys gives about two programs an SM. A launch that fills the GPU runs in waves of about one
    program an SM; over long contexts its last wave can be nearly empty (408 programs on 132 SMs: 4 waves, the last
    3% full), and splitting the keys in s evens it out: the s that minimises ceil(programs * s / SMs) / s, where it
    beats fewer splits by 5%."""
    cap = min(PREFILL_MAX_SPLITS, max_seq_len // PREFILL_SPLIT_KEYS)
    if programs < num_sms:
        return max(1, min(-(-2 * num_sms // max(1, programs)), cap))
    best, best_waves = 1, -(-programs // num_sms)
    for splits in range(2, min(cap, PREFILL_WAVE_SPLITS) + 1):
        waves = -(-programs * splits // num_sms) / splits
        if waves < 0.95 * best_waves:  # partials and their reduce cost a few percent
            best, best_waves = splits, waves
    return best


def paged_attention_triton(
    query: torch.Tensor,  # [T, H, D]
    kv_cache_layer: torch.Tensor,  # [2, NB, BS, KVH, D]
    meta,  # AttentionMetadata
    scale: float,
    plan: TritonAttentionPlan | None = None,
    gate: torch.Tensor | None = None,  # [T, H, D]: Qwen3-Next's output gate
    k_scale: float = 1.0,  # an fp8 cache's scales (the layer's; unused for other caches)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H, D]
    """Attention over the paged cache; with ``gate``, ``out * sigmoid(gate)`` rounded as torch does (fused into
    the decode kernels' stores; after the prefill kernel, in torch)."""
    if meta.is_decode_only:
        from kernels.triton_decode_attention import paged_decode_attention_triton  # that module builds on this one

        return paged_decode_attention_triton(query, kv_cache_layer, meta, scale, plan, gate, k_scale, v_scale)
    if isinstance(plan, TritonAttentionPlan) and plan.decode_rows is not None:
        from kernels.triton_decode_attention import paged_rows_attention_triton

        return paged_rows_attention_triton(query, kv_cache_layer, meta, scale, plan, gate, rows=plan.decode_rows,
                                           k_scale=k_scale, v_scale=v_scale)
    out = paged_prefill_attention_triton(query, kv_cache_layer, meta, scale, plan, k_scale, v_scale)
    return out if gate is None else out * torch.sigmoid(gate)
