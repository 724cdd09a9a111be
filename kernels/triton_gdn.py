"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) in Triton: same contracts as the torch references in
``kernels/gdn.py`` (the oracle; its docstring has the varlen layout, the state slots and the math).

Decode (every sequence one token) must be CUDA-graph capturable: the kernels here read the sequence bounds, slots
and ``has_initial_state`` on the device, never sync, and size their grids from (T, B, C) or (B, HV, Dv) only.

* the causal conv: kernels/triton_gdn_conv.py.
* ``gated_delta_rule_recurrent_triton``: grid ``(B, HV, Dv / BV)``; each program keeps its ``[Dk, BV]`` fp32 slice
  of the state in registers (BV = 32: 128-byte rows, coalesced), walks its sequence token by token, and writes the
  state back once. Decode reads and writes the state once; also a correct (slow) path at any length.
* ``gated_delta_rule_chunked_triton``: the chunked form on tensor cores (kernels/triton_gdn_chunked.py).
* Both delta-rule paths take the raw gate inputs (a, b, A_log, dt_bias) and compute the decay and beta gates in
  their kernels (``gate_values``; the chunked path in its prep kernel), which spares every layer a chain of small
  torch kernels (7 launches a layer on the decode step).
* ``rms_norm_gated_triton``: row tiles, rounding like the reference (normed in x's dtype, weight product in the
  promoted dtype, silu(z) product in fp32).

Slots must be distinct within a batch, except the null slot 0: padding rows that share it race on its contents,
which nobody reads as a state.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import (L2_HINT_LANES, gdc_launch_dependents, gdc_wait, hint_span, l2_hints, pdl_launch,
                                   prefetch_l2)
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton
from kernels.triton_gdn_chunked import chunked_forward, gate_values, load_state_slice

_TL_DTYPES = {} if tl is None else {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least) (block sizes; shared with kernels/triton_gdn_conv.py)."""
    return max(least, 1 << (max(1, n) - 1).bit_length())


def check_varlen(state_slots: torch.Tensor, query_start_loc: torch.Tensor, has_initial_state: torch.Tensor
                  ) -> torch.Tensor:
    """Shapes only (no host sync); returns has_initial_state as bool. Shared with kernels/triton_gdn_conv.py."""
    B = state_slots.shape[0]
    if state_slots.dim() != 1 or query_start_loc.shape != (B + 1,) or has_initial_state.shape != (B,):
        raise ValueError(f"state_slots {tuple(state_slots.shape)}, query_start_loc {tuple(query_start_loc.shape)} "
                         f"and has_initial_state {tuple(has_initial_state.shape)} do not describe one batch")
    return has_initial_state if has_initial_state.dtype == torch.bool else has_initial_state.bool()


@_jit
def conv_token_channels(x_ptr, t, stride_xt, cols, c_ok, w_ptr, stride_wc, stride_wk, st_row, stride_sc, stride_sk,
                        init, K: tl.constexpr, KM1_PAD: tl.constexpr):
    """One token's causal conv and SiLU over channels ``cols``, from the window at ``st_row`` (one slot's state),
    rounded to x's dtype as ``_conv_update_kernel`` (kernels/triton_gdn_conv.py) stores it: (y fp32, the new
    window, its pointers, its mask), for the caller to write once every program reading the window has read it
    (K >= 2, no bias)."""
    jj = tl.arange(0, KM1_PAD)
    m = c_ok[:, None] & (jj < K - 1)[None, :]
    st = st_row + cols[:, None] * stride_sc + jj[None, :] * stride_sk
    x = tl.load(x_ptr + t * stride_xt + cols, mask=c_ok, other=0.0)
    window = tl.load(st, mask=m & init, other=0.0).to(x.dtype).to(tl.float32)
    shifted = tl.load(st + stride_sk, mask=m & (jj < K - 2)[None, :] & init, other=0.0)
    w_win = tl.load(w_ptr + cols[:, None] * stride_wc + jj[None, :] * stride_wk, mask=m, other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + cols * stride_wc + (K - 1) * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
    acc = tl.sum(window * w_win, 1) + x.to(tl.float32) * w_last
    y = (acc / (1.0 + tl.exp(-acc))).to(x.dtype).to(tl.float32)
    sd = st_row.dtype.element_ty
    new_window = tl.where((jj == K - 2)[None, :], x.to(sd)[:, None], shifted.to(x.dtype).to(sd))
    return y, new_window, st, m


@_jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, o_ptr, state_ptr, slots_ptr, qsl_ptr, init_ptr,
    z_ptr, norm_w_ptr, eps,
    scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, stride_ot,
    stride_oh, stride_ss, stride_sh, stride_sk, stride_zt, stride_zh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, NORM: tl.constexpr, PROD_DTYPE: tl.constexpr, PDL: tl.constexpr = False,
    cx_ptr=None, cw_ptr=None, cs_ptr=None, tickets_ptr=None, stride_cxt=0, stride_cwc=0, stride_cwk=0,
    stride_css=0, stride_csc=0, stride_csk=0, key_dim=0, num_k_heads=0,
    CONV: tl.constexpr = False, CONV_K: tl.constexpr = 4, KM1_PAD: tl.constexpr = 4,
    hint_ptr=None, hint_bytes=0, L2_HINT: tl.constexpr = False,
):
    """NORM (BV covers DV): each token's output goes through the gated RMSNorm (``rms_norm_gated_ref``'s rounding)
    before it is stored.

    CONV (one token a row, BV covers DV): q, k and v come straight from the projection (``cx``) through the causal
    conv, computed here (``conv_token_channels``) instead of by the conv kernel. A program writes its v channels'
    new window itself; the q/k channels of a key head are read by its GROUP value heads' programs, and the last of
    them to take a ticket (an atomic count per row and key head, set back to 0 by that program) writes their new
    window, once every reader has read the old one.

    L2_HINT: before the wait, the programs ask L2 for ``hint_bytes`` at ``hint_ptr`` (the output projection)."""
    if L2_HINT:
        part = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
        prefetch_l2(hint_ptr, hint_bytes, part, tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2),
                    L2_HINT_LANES)
    if PDL:  # dependent launch (kernels/triton_compat.py): the kernel before finishes first
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.load(qsl_ptr + b)
    length = tl.load(qsl_ptr + b + 1) - lo
    if length <= 0:  # the reference leaves an empty sequence's state alone
        return
    hk = h // GROUP
    dk, dv, k_ok, v_ok, s_mask, s_ptrs, state = load_state_slice(
        slots_ptr, init_ptr, state_ptr, b, h, stride_ss, stride_sh, stride_sk, DK, DV, DK_PAD, BV)
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    if CONV:
        t0 = lo.to(tl.int64)
        st_row = cs_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_css
        fresh_or_not = tl.load(init_ptr + b) != 0
        q_conv, q_window, q_at, q_mask = conv_token_channels(
            cx_ptr, t0, stride_cxt, hk * DK + dk, k_ok, cw_ptr, stride_cwc, stride_cwk, st_row, stride_csc,
            stride_csk, fresh_or_not, CONV_K, KM1_PAD)
        k_conv, k_window, k_at, k_mask = conv_token_channels(
            cx_ptr, t0, stride_cxt, key_dim + hk * DK + dk, k_ok, cw_ptr, stride_cwc, stride_cwk, st_row,
            stride_csc, stride_csk, fresh_or_not, CONV_K, KM1_PAD)
        v_conv, v_window, v_at, v_mask = conv_token_channels(
            cx_ptr, t0, stride_cxt, 2 * key_dim + h * DV + dv, v_ok, cw_ptr, stride_cwc, stride_cwk, st_row,
            stride_csc, stride_csk, fresh_or_not, CONV_K, KM1_PAD)
        # after the q/k windows are read (acq_rel orders those loads before it)
        ticket = tl.atomic_add(tickets_ptr + b * num_k_heads + hk, 1, sem="acq_rel")
    for i in range(0, length):
        t = (lo + i).to(tl.int64)
        if CONV:
            q, k, v = q_conv, k_conv, v_conv
        else:
            q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + dk, mask=k_ok, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + dk, mask=k_ok, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + dv, mask=v_ok, other=0.0).to(tl.float32)
        g, beta = gate_values(tl.load(a_ptr + t * stride_at + h), tl.load(b_ptr + t * stride_bt + h), a_log, dt_bias)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        state = state * tl.exp(g)
        u = (v - tl.sum(state * k[:, None], 0)) * beta
        state = state + k[:, None] * u[None, :]
        o = tl.sum(state * q[:, None], 0)
        if NORM:
            o = o.to(o_ptr.dtype.element_ty).to(tl.float32)  # the reference norms the rounded output
            o = gated_norm_values(o, tl.rsqrt(tl.sum(o * o, 0) / DV + eps),
                                  tl.load(norm_w_ptr + dv, mask=v_ok, other=0.0).to(tl.float32),
                                  tl.load(z_ptr + t * stride_zt + h * stride_zh + dv, mask=v_ok, other=0.0),
                                  o_ptr.dtype.element_ty, PROD_DTYPE)
        tl.store(o_ptr + t * stride_ot + h * stride_oh + dv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)
    if CONV:
        tl.debug_barrier()  # every thread of this program has read the windows it is about to overwrite
        tl.store(v_at, v_window, mask=v_mask)
        if ticket == GROUP - 1:  # the key head's last reader
            tl.store(q_at, q_window, mask=q_mask)
            tl.store(k_at, k_window, mask=k_mask)
            tl.atomic_xchg(tickets_ptr + b * num_k_heads + hk, 0, sem="relaxed")


def _gdn_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor, state_slots: torch.Tensor,
              query_start_loc: torch.Tensor, has_initial_state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Shape checks (no host sync); last dims made contiguous where they are not (q/k/v heads and a/b columns are
    views into the projection rows, whose strides the kernels take, so the layer's inputs go in uncopied)."""
    T, HK, dk = q.shape
    HV, dv = v.shape[1], v.shape[2]
    if (k.shape != q.shape or v.shape[0] != T or a.shape != (T, HV) or b.shape != (T, HV) or HV % HK
            or A_log.shape != (HV,) or dt_bias.shape != (HV,)):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)} "
                         f"do not fit together")
    if ssm_states.shape[1:] != (HV, dk, dv) or ssm_states.stride(3) != 1:
        raise ValueError(f"ssm_states {tuple(ssm_states.shape)} must be [slots, {HV}, {dk}, {dv}] with a contiguous "
                         f"last dim (it is updated in place)")
    init = check_varlen(state_slots, query_start_loc, has_initial_state)
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    a, b, A_log, dt_bias = (t if t.stride(-1) == 1 else t.contiguous() for t in (a, b, A_log, dt_bias))
    return q, k, v, a, b, A_log, dt_bias, init


def gated_delta_rule_recurrent_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, ssm_states: torch.Tensor, state_slots: torch.Tensor, query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor, use_qk_l2norm: bool = True,
    gated_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, l2_hint: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``gated_delta_rule_varlen_ref``, token by token: o [T, HV, Dv] in v's dtype, the state
    of each ``ssm_states[state_slots[b]]`` updated in place. Capturable in a CUDA graph: with a/b columns of the
    projection (row-strided, last dim contiguous) it launches the one kernel and no torch op. ``gated_norm``
    ``(z [T, HV, Dv], weight [Dv], eps)``: o is ``rms_norm_gated_ref(o, z, weight, eps)`` instead, in the same
    kernel (a program then holds a head's whole [Dk, Dv] state). ``conv`` ``(x [T, C], weight [C, K],
    conv_states)``, with ``gated_norm`` and at most one token a row: q, k and v are the conv's SiLU outputs of
    x's channels (q, k of every key head, then v), computed in this kernel with the conv window update
    (``causal_conv1d_varlen_ref``'s); q/k/v passed in only give the shapes. ``l2_hint``: a weight the kernel asks
    L2 for when L2 hints are on (``kernels/triton_compat.py``)."""
    q, k, v, a, b, A_log, dt_bias, init = _gdn_args(q, k, v, a, b, A_log, dt_bias, ssm_states, state_slots,
                                                    query_start_loc, has_initial_state)
    T, HK, dk = q.shape
    HV, dv = v.shape[1], v.shape[2]
    o = torch.empty(T, HV, dv, dtype=v.dtype, device=v.device)
    B = state_slots.shape[0]
    if gated_norm is not None:
        z, norm_w, eps = gated_norm
        if z.shape != v.shape or z.stride(2) != 1 or norm_w.shape != (dv,):
            raise ValueError(f"gated norm z {tuple(z.shape)} / weight {tuple(norm_w.shape)} do not fit v "
                             f"{tuple(v.shape)} (z's last dim must be contiguous)")
        # one program a head, 4 warps: at batch 1 no slower than the split kernel plus the norm kernel, and 5-30%
        # faster from batch 4 to 256 (8 warps lost up to 1.45x at 256; results/gdn-decode-ab-h200-bb9dc93.json)
        bv, warps, prod = pow2(dv, 16), 4, _TL_DTYPES[torch.promote_types(norm_w.dtype, v.dtype)]
        z_strides = (z.stride(0), z.stride(1))
    else:
        z, norm_w, eps, z_strides = o, o, 0.0, (0, 0)
        bv, warps, prod = min(32, pow2(dv, 16)), 4, _TL_DTYPES[v.dtype]
    if B == 0 or T == 0:
        return o
    fused = _conv_args(conv, q, v, HK, B, gated_norm is not None) if conv is not None else {}
    hint_ptr, hint_bytes = hint_span(l2_hint if l2_hints(q) else None, q)
    if hint_bytes:
        fused.update(hint_ptr=hint_ptr, hint_bytes=hint_bytes, L2_HINT=True)
    _recurrent_kernel[(B, HV, triton.cdiv(dv, bv))](
        q, k, v, a, b, A_log, dt_bias, o, ssm_states, state_slots, query_start_loc, init, z, norm_w, eps, dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        o.stride(0), o.stride(1), ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), *z_strides,
        GROUP=HV // HK, DK=dk, DV=dv, DK_PAD=pow2(dk, 16), BV=bv, L2NORM=bool(use_qk_l2norm),
        NORM=gated_norm is not None, PROD_DTYPE=prod, num_warps=warps, **fused, **pdl_launch(q),
    )
    return o


_TICKETS: dict[torch.device, list[torch.Tensor]] = {}  # every buffer handed out stays alive: graphs hold them


def _conv_tickets(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 counters the fused conv's programs take tickets from; each kernel leaves them zero. Grown
    outside graph capture only (the capture's warm-up run of the largest batch allocates them first)."""
    held = _TICKETS.setdefault(device, [])
    if not held or held[-1].numel() < size:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the conv tickets must be allocated before CUDA graph capture (run the step once)")
        held.append(torch.zeros(max(size, 64), dtype=torch.int32, device=device))
    return held[-1]


def _conv_args(conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], q: torch.Tensor, v: torch.Tensor, HK: int,
               B: int, normed: bool) -> dict:
    x, weight, conv_states = conv
    T, _, dk = q.shape
    channels = 2 * HK * dk + v.shape[1] * v.shape[2]
    K = weight.shape[1]
    if not normed or K < 2 or x.shape != (T, channels) or x.stride(1) != 1 or weight.shape[0] != channels:
        raise ValueError(f"fused conv: x {tuple(x.shape)}, weight {tuple(weight.shape)} do not fit q {tuple(q.shape)}"
                         f" / v {tuple(v.shape)} (gated norm on, kernel >= 2, x's last dim contiguous)")
    if conv_states.shape[1:] != (channels, K - 1):
        raise ValueError(f"conv_states {tuple(conv_states.shape)} must be [slots, {channels}, {K - 1}]")
    return dict(cx_ptr=x, cw_ptr=weight, cs_ptr=conv_states, tickets_ptr=_conv_tickets(x.device, B * HK),
                stride_cxt=x.stride(0), stride_cwc=weight.stride(0), stride_cwk=weight.stride(1),
                stride_css=conv_states.stride(0), stride_csc=conv_states.stride(1), stride_csk=conv_states.stride(2),
                key_dim=HK * dk, num_k_heads=HK, CONV=True, CONV_K=K, KM1_PAD=pow2(K - 1))


def gated_delta_rule_chunked_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, ssm_states: torch.Tensor, state_slots: torch.Tensor, query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor, use_qk_l2norm: bool = True, query_start_loc_host: list[int] | None = None,
) -> torch.Tensor:
    """Same contract as ``gated_delta_rule_varlen_ref``, in 64-token chunks on tensor cores (any varlen batch).
    The kernels find their chunks on the device, so the host copy of query_start_loc is optional: given, a batch
    of single tokens takes the recurrent kernel instead (one launch, no scratch)."""
    if query_start_loc_host is not None and all(
            b - a <= 1 for a, b in zip(query_start_loc_host, query_start_loc_host[1:])):
        return gated_delta_rule_recurrent_triton(q, k, v, a, b, A_log, dt_bias, ssm_states, state_slots,
                                                 query_start_loc, has_initial_state, use_qk_l2norm)
    q, k, v, a, b, A_log, dt_bias, init = _gdn_args(q, k, v, a, b, A_log, dt_bias, ssm_states, state_slots,
                                                    query_start_loc, has_initial_state)
    T, HV, dv = v.shape
    o = torch.empty(T, HV, dv, dtype=v.dtype, device=v.device)
    if state_slots.shape[0] == 0 or T == 0:
        return o
    chunked_forward(q, k, v, a, b, A_log, dt_bias, o, ssm_states, state_slots, query_start_loc, init, use_qk_l2norm)
    return o


@_jit
def gated_norm_values(x, rstd, w, z, X_DTYPE: tl.constexpr, PROD_DTYPE: tl.constexpr):
    """``rms_norm_gated_ref``'s rounding, given x (fp32 holding x-dtype values), its rstd and the weight (both
    broadcast to x): normed rounded to x's dtype, weight * normed in the promoted dtype, silu(z) product in fp32."""
    normed = (x * rstd).to(X_DTYPE).to(tl.float32)
    gated = (w * normed).to(PROD_DTYPE).to(tl.float32)
    z = z.to(tl.float32)
    return gated * (z / (1.0 + tl.exp(-z)))


@_jit(do_not_specialize=["n_rows"])
def _rms_norm_gated_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, n_rows, D, eps, stride_x, stride_z, stride_y,
    PROD_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    c_ok = cols < D
    mask = (rows < n_rows)[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0)
    y = gated_norm_values(x, tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None], w[None, :], z, x_ptr.dtype.element_ty,
                          PROD_DTYPE)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_gated_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``rms_norm_gated_ref``: x, z [..., D] (rows may be strided), weight [D] -> y like x."""
    D = x.shape[-1]
    if z.shape != x.shape or weight.shape != (D,):
        raise ValueError(f"x {tuple(x.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)} do not fit")
    x2, z2 = (t.reshape(-1, D) if t.dim() != 2 else t for t in (x, z))
    x2, z2 = (t if t.stride(1) == 1 else t.contiguous() for t in (x2, z2))
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[0]
    if n == 0:
        return y.view(x.shape)
    block_d = pow2(D, 16)
    block_r = max(1, min(16, 2048 // block_d))
    _rms_norm_gated_kernel[(triton.cdiv(n, block_r),)](
        x2, z2, weight, y, n, D, eps, x2.stride(0), z2.stride(0), y.stride(0),
        PROD_DTYPE=_TL_DTYPES[torch.promote_types(weight.dtype, x.dtype)], BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=4,
    )
    return y.view(x.shape)
