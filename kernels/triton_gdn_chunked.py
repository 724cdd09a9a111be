"""Chunked Gated DeltaNet for prefill: the kernels behind ``gated_delta_rule_chunked_triton`` (kernels/triton_gdn.py).

The math is the chunked form in the module docstring of ``kernels/gdn.py``. Chunks are BT = 64 tokens of one
sequence (its last chunk may be shorter) and are found on the device: sequence b owns the virtual tiles from
``qsl[b] // BT + b`` of a ``T // BT + B`` grid (the paged-attention prefill trick) and spare tiles exit, so the
launches depend only on (T, B) and no host-built index is copied in.

1. ``_chunk_prep_kernel``, grid (tiles, HV), all chunks in parallel: the gates from the raw projections
   (``gate_values``), written to ``gates [2, T, HV]`` fp32 (g, beta) for the scan; the strictly lower
   ``A_tj = beta_t exp(G_t - G_j) k_t.k_j`` (one tl.dot) and the unit lower-triangular inverse ``(I + A)^-1``,
   written to ``tinv [T, HV, BT]`` fp32 (row = token). The inverse: the four 16x16 diagonal blocks by forward
   substitution (16 register-only steps, all four blocks at once), then two levels of block merges
   ``[[P, 0], [R, Q]]^-1 = [[P^-1, 0], [-Q^-1 R P^-1, Q^-1]]`` with tl.dot. A is staged in the same rows, which
   only this program touches; each stage reads what the previous one wrote from other threads, so a CTA barrier
   (``tl.debug_barrier``) separates them and the re-reads bypass L1 (``.cg``).
2. ``_chunk_scan_kernel``, grid (B, HV, Dv / BV), BV = 64: one program walks its sequence's chunks carrying the fp32
   state slice ``S [Dk, BV]`` in registers, six tl.dots a chunk (three on the S-to-S path)::

       U = (I + A)^-1 (beta * (V - e^G * K S))      O = e^G * Q S + (Q K^T . decay) U
       S = e^G_end S + (e^(G_end - G) * K)^T U

q/k are l2-normalised in both kernels (row scales: no normalised copy goes through memory). Dot operands are fp32:
tf32 tensor cores for 16-bit models, exact fp32 ("ieee", slow) for fp32 inputs and under the interpreter.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import INTERPRET  # interpreter: tl.dot on 16-bit inputs is wrong, use fp32
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton
from kernels.triton_paged_attention import find_sequence

BT = 64  # tokens per chunk (the four 16-row blocks of the inverse assume 64)
# q/k l2norm: x * rsqrt(sum(x^2) + 1e-6), the eps of kernels.gdn.l2norm (a literal in the kernels)


def dot_precision(*tensors: torch.Tensor) -> str:
    """tf32 tensor cores for 16-bit models; exact fp32 ("ieee") for fp32 inputs and under the interpreter. fp32
    is a correctness path (tests, fp32 checkpoints): its 64x128 FMA dots spill to local memory on sm_90, and
    3xTF32 would need ~225 KB of shared memory, at the limit."""
    return "ieee" if INTERPRET or all(t.dtype == torch.float32 for t in tensors) else "tf32"


@_jit
def gate_values(a, b, a_log, dt_bias):
    """``kernels.gdn.gdn_gates`` on loaded values (scalars or blocks; a_log, dt_bias fp32): (g fp32, beta fp32).
    softplus as torch's: x above 20 passes through, else log1p(exp(x)), with log1p(e) = log(u) * e / (u - 1)
    for u = 1 + e (exact where 1 + e rounds; e itself where u is 1), since log(1 + e) alone loses small e. beta
    is sigmoid(b) in fp32 rounded to b's dtype, as torch computes it on a 16-bit tensor. Shared by the recurrent
    and the chunk-prep kernels."""
    x = a.to(tl.float32) + dt_bias
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    small = u == 1.0
    log1p = tl.where(small, e, tl.log(u) * (e / tl.where(small, 1.0, u - 1.0)))
    g = -tl.exp(a_log) * tl.where(x > 20.0, x, log1p)
    beta = (1.0 / (1.0 + tl.exp(-b.to(tl.float32)))).to(b.dtype).to(tl.float32)
    return g, beta


@_jit
def load_state_slice(slots_ptr, init_ptr, state_ptr, b, h, stride_ss, stride_sh, stride_sk,
                     DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, BV: tl.constexpr):
    """A program's [DK_PAD, BV] fp32 slice of sequence b's value head h state (zeros when it starts fresh), with
    its indices, masks and pointers for the write back. Shared by the recurrent and the chunk-scan kernels."""
    dk = tl.arange(0, DK_PAD)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    k_ok = dk < DK
    v_ok = dv < DV
    s_mask = k_ok[:, None] & v_ok[None, :]
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    init = tl.load(init_ptr + b) != 0
    state = tl.load(s_ptrs, mask=s_mask & init, other=0.0).to(tl.float32)
    return dk, dv, k_ok, v_ok, s_mask, s_ptrs, state


@_jit
def _merge_blocks(base, n, off, RS: tl.constexpr, SIZE: tl.constexpr, PRECISION: tl.constexpr):
    """Rows/cols off..off+2*SIZE of the inverse: the lower-left block -Q^-1 R P^-1 from the two diagonal inverses
    (already in place) and R (A's block, overwritten)."""
    i = tl.arange(0, SIZE)
    top = off + i
    bot = off + SIZE + i
    bot_ok = (bot < n)[:, None]
    p_inv = tl.load(base + top[:, None] * RS + top[None, :], mask=(top < n)[:, None], other=0.0, cache_modifier=".cg")
    q_inv = tl.load(base + bot[:, None] * RS + bot[None, :], mask=bot_ok, other=0.0, cache_modifier=".cg")
    r = tl.load(base + bot[:, None] * RS + top[None, :], mask=bot_ok, other=0.0, cache_modifier=".cg")
    x = -tl.dot(q_inv, tl.dot(r, p_inv, input_precision=PRECISION), input_precision=PRECISION)
    tl.debug_barrier()
    tl.store(base + bot[:, None] * RS + top[None, :], x, mask=bot_ok)


@_jit(do_not_specialize=["num_seqs", "num_tokens"])
def _chunk_prep_kernel(
    k_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, qsl_ptr, gates_ptr, tinv_ptr, num_seqs, num_tokens, stride_kt,
    stride_kh, stride_at, stride_bt,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr, L2NORM: tl.constexpr,
    PRECISION: tl.constexpr, BT: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = find_sequence(qsl_ptr, num_seqs, tile, BT)
    lo = tl.load(qsl_ptr + b)
    t0 = (tile - (lo // BT + b)) * BT
    n = tl.minimum(tl.load(qsl_ptr + b + 1) - lo - t0, BT)  # tokens in this chunk
    if n <= 0:
        return
    r = tl.arange(0, BT)
    r_ok = r < n
    tok = (lo + t0 + r).to(tl.int64)
    g, beta = gate_values(tl.load(a_ptr + tok * stride_at + h, mask=r_ok, other=0.0),
                          tl.load(b_ptr + tok * stride_bt + h, mask=r_ok, other=0.0),
                          tl.load(a_log_ptr + h).to(tl.float32), tl.load(dt_bias_ptr + h).to(tl.float32))
    G = tl.cumsum(tl.where(r_ok, g, 0.0), 0)
    beta = tl.where(r_ok, beta, 0.0)
    # for the scan, whose serial loop is the long pole: reading these costs it less than computing them
    tl.store(gates_ptr + tok * HV + h, g, mask=r_ok)
    tl.store(gates_ptr + num_tokens * HV + tok * HV + h, beta, mask=r_ok)
    dk = tl.arange(0, DK_PAD)
    k = tl.load(k_ptr + tok[:, None] * stride_kt + (h // GROUP) * stride_kh + dk[None, :],
                mask=r_ok[:, None] & (dk < DK)[None, :], other=0.0).to(tl.float32)
    if L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
    lower = r[:, None] > r[None, :]
    decay = tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0))
    a = tl.where(lower, beta[:, None] * decay * tl.dot(k, tl.trans(k), input_precision=PRECISION), 0.0)
    RS: tl.constexpr = HV * BT  # row stride of tinv
    base = tinv_ptr + (lo + t0).to(tl.int64) * RS + h * BT
    tl.store(base + r[:, None] * RS + r[None, :], a, mask=r_ok[:, None])
    tl.debug_barrier()

    # the diagonal 16x16 blocks: X[d] = (I + A_dd)^-1 row by row, X_i = e_i - sum_{j<i} A_ij X_j
    NB: tl.constexpr = BT // 16
    d = tl.arange(0, NB)
    i16 = tl.arange(0, 16)
    rows3 = (d * 16)[:, None, None] + i16[None, :, None]
    blocks = base + rows3 * RS + (d * 16)[:, None, None] + i16[None, None, :]
    a3 = tl.load(blocks, mask=rows3 < n, other=0.0, cache_modifier=".cg")  # [NB, 16, 16], strictly lower
    x = tl.zeros([NB, 16, 16], dtype=tl.float32) + tl.where(i16[:, None] == i16[None, :], 1.0, 0.0)[None, :, :]
    for i in range(16):
        a_i = tl.sum(tl.where((i16 == i)[None, :, None], a3, 0.0), 1)  # row i of each block, zero from column i
        x_i = tl.where(i16 == i, 1.0, 0.0)[None, :] - tl.sum(a_i[:, :, None] * x, 1)
        x = tl.where((i16 == i)[None, :, None], x_i[:, None, :], x)
    tl.debug_barrier()
    tl.store(blocks, x, mask=rows3 < n)
    tl.debug_barrier()
    _merge_blocks(base, n, 0, RS, 16, PRECISION)
    _merge_blocks(base, n, 32, RS, 16, PRECISION)
    tl.debug_barrier()
    _merge_blocks(base, n, 0, RS, 32, PRECISION)


@_jit
def _chunk_scan_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tinv_ptr, o_ptr, state_ptr, slots_ptr, qsl_ptr, init_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
    BV: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr, BT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.load(qsl_ptr + b)
    length = tl.load(qsl_ptr + b + 1) - lo
    if length <= 0:  # the reference leaves an empty sequence's state alone
        return
    hk = h // GROUP
    dk, dv, k_ok, v_ok, s_mask, s_ptrs, state = load_state_slice(
        slots_ptr, init_ptr, state_ptr, b, h, stride_ss, stride_sh, stride_sk, DK, DV, DK_PAD, BV)
    r = tl.arange(0, BT)
    causal = r[None, :] <= r[:, None]
    for c in range(0, tl.cdiv(length, BT)):
        r_ok = r < length - c * BT
        tok = (lo + c * BT + r).to(tl.int64)
        g = tl.load(g_ptr + tok * HV + h, mask=r_ok, other=0.0)
        G = tl.cumsum(g, 0)  # padding rows add 0: G there is G_end
        g_end = tl.sum(g, 0)
        beta = tl.load(beta_ptr + tok * HV + h, mask=r_ok, other=0.0)
        qk_mask = r_ok[:, None] & k_ok[None, :]
        k = tl.load(k_ptr + tok[:, None] * stride_kt + hk * stride_kh + dk[None, :], mask=qk_mask, other=0.0)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + hk * stride_qh + dk[None, :], mask=qk_mask, other=0.0)
        k = k.to(tl.float32)
        q = q.to(tl.float32)
        if L2NORM:
            k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
            q = q * (tl.rsqrt(tl.sum(q * q, 1) + 1e-6) * scale)[:, None]
        else:
            q = q * scale
        v = tl.load(v_ptr + tok[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=r_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        t_inv = tl.load(tinv_ptr + tok[:, None] * (HV * BT) + h * BT + r[None, :], mask=r_ok[:, None] & causal,
                        other=0.0)
        e_g = tl.exp(G)
        rhs = beta[:, None] * (v - e_g[:, None] * tl.dot(k, state, input_precision=PRECISION))
        u = tl.dot(t_inv, rhs, input_precision=PRECISION)
        decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))
        p = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay, 0.0)
        o = e_g[:, None] * tl.dot(q, state, input_precision=PRECISION) + tl.dot(p, u, input_precision=PRECISION)
        tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + dv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & v_ok[None, :])
        u_tail = u * tl.exp(g_end - G)[:, None]  # scaling u's rows, not k's: k need not stay in registers
        state = state * tl.exp(g_end) + tl.dot(tl.trans(k), u_tail, input_precision=PRECISION)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)


def chunked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, o: torch.Tensor, ssm_states: torch.Tensor, state_slots: torch.Tensor,
    query_start_loc: torch.Tensor, has_initial_state: torch.Tensor, use_qk_l2norm: bool,
) -> None:
    """Launch both kernels on checked arguments (``gated_delta_rule_chunked_triton`` does the checks): q, k
    [T, HK, Dk], v and o [T, HV, Dv] with contiguous last dims, the raw gate inputs a and b [T, HV] with
    contiguous last dims (rows may be strided), A_log and dt_bias [HV]."""
    T, HK, dk = q.shape
    HV, dv = v.shape[1], v.shape[2]
    B = state_slots.shape[0]
    precision = dot_precision(q, k, v)
    dk_pad = max(16, triton.next_power_of_2(dk))
    bv = min(64, max(16, triton.next_power_of_2(dv)))
    gates = torch.empty(2, T, HV, dtype=torch.float32, device=q.device)
    tinv = torch.empty(T, HV, BT, dtype=torch.float32, device=q.device)
    _chunk_prep_kernel[(T // BT + B, HV)](
        k, a, b, A_log, dt_bias, query_start_loc, gates, tinv, B, T, k.stride(0), k.stride(1), a.stride(0),
        b.stride(0),
        HV=HV, GROUP=HV // HK, DK=dk, DK_PAD=dk_pad, L2NORM=bool(use_qk_l2norm), PRECISION=precision, BT=BT,
        num_warps=4,
    )
    _chunk_scan_kernel[(B, HV, triton.cdiv(dv, bv))](
        q, k, v, gates[0], gates[1], tinv, o, ssm_states, state_slots, query_start_loc, has_initial_state, dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        HV=HV, GROUP=HV // HK, DK=dk, DV=dv, DK_PAD=dk_pad, BV=bv, L2NORM=bool(use_qk_l2norm),
        # 4 warps: the 64-row dots are one warpgroup's (8 warps would duplicate them). BV 64, one stage: the best of
        # a sweep over BV 16/32/64 x 4/8 warps x 1-3 stages at Dk = Dv = 128, bf16, 16 prompts of 512 tokens
        # (bench/results/gdn-chunk-scan-sweep-*.json)
        PRECISION=precision, BT=BT, num_warps=4, num_stages=1,
    )
