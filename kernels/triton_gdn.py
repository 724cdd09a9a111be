"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) in Triton: same contracts as the torch references in
``kernels/gdn.py`` (the oracle; its docstring has the varlen layout, the state slots and the math).

Decode (every sequence one token) must be CUDA-graph capturable: the kernels here read the sequence bounds, slots
and ``has_initial_state`` on the device, never sync, and size their grids from (T, B, C) or (B, HV, Dv) only.

* the causal conv: kernels/triton_gdn_conv.py.
* ``gated_delta_rule_recurrent_triton``: grid ``(B, HV, Dv / BV)``; each program keeps its ``[Dk, BV]`` fp32 slice
  of the state in registers (BV = 32: 128-byte rows, coalesced), walks its sequence token by token, and writes the
  state back once. Decode reads and writes the state once; also a correct (slow) path at any length. With
  ``keep_slots`` (speculative verify rows) it also stores the slice after each token that has a keep slot.
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

from kernels.triton_compat import pdl_launch, pdl_wait
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


def check_keep(keep_slots: torch.Tensor | None, num_tokens: int) -> None:
    """Shape and dtype only (no host sync): one integer slot a token. Shared with kernels/triton_gdn_conv.py."""
    if keep_slots is not None and (keep_slots.shape != (num_tokens,) or keep_slots.dtype not in (torch.int32,
                                                                                                   torch.int64)):
        raise ValueError(f"keep_slots {tuple(keep_slots.shape)} {keep_slots.dtype} must hold one int32/int64 slot "
                         f"for each of {num_tokens} tokens")


@_jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, o_ptr, state_ptr, slots_ptr, qsl_ptr, init_ptr,
    z_ptr, norm_w_ptr, eps, keep_ptr,
    scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, stride_ot,
    stride_oh, stride_ss, stride_sh, stride_sk, stride_zt, stride_zh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, NORM: tl.constexpr, PROD_DTYPE: tl.constexpr, KEEP: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """NORM (BV covers DV): each token's output goes through the gated RMSNorm (``rms_norm_gated_ref``'s rounding)
    before it is stored. KEEP: after token t, the slice also goes to slot ``keep_ptr[t]`` when that is >= 0."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.load(qsl_ptr + b)
    length = tl.load(qsl_ptr + b + 1) - lo
    # The state (written by an earlier step), the slots and bounds (host copies) and the weights may be read
    # before the wait: loading the state overlaps the kernels this one waits on.
    hk = h // GROUP
    dk, dv, k_ok, v_ok, s_mask, s_ptrs, state = load_state_slice(
        slots_ptr, init_ptr, state_ptr, b, h, stride_ss, stride_sh, stride_sk, DK, DV, DK_PAD, BV)
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    pdl_wait(PDL)  # dependent launch (kernels/triton_compat.py): every program waits, before it writes or exits
    if length <= 0:  # the reference leaves an empty sequence's state alone
        return
    if KEEP:  # the slice's place in any slot: the row's own pointers less its slot
        keep_ptrs = state_ptr + h * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    for i in range(0, length):
        t = (lo + i).to(tl.int64)
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
        if KEEP:  # written after the wait, like the row's own slot; a keep slot is nobody's state this step
            keep = tl.load(keep_ptr + t).to(tl.int64)
            tl.store(keep_ptrs + keep * stride_ss, state.to(state_ptr.dtype.element_ty), mask=s_mask & (keep >= 0))
        o = tl.sum(state * q[:, None], 0)
        if NORM:
            o = o.to(o_ptr.dtype.element_ty).to(tl.float32)  # the reference norms the rounded output
            o = gated_norm_values(o, tl.rsqrt(tl.sum(o * o, 0) / DV + eps),
                                  tl.load(norm_w_ptr + dv, mask=v_ok, other=0.0).to(tl.float32),
                                  tl.load(z_ptr + t * stride_zt + h * stride_zh + dv, mask=v_ok, other=0.0),
                                  o_ptr.dtype.element_ty, PROD_DTYPE)
        tl.store(o_ptr + t * stride_ot + h * stride_oh + dv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)


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
    gated_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, keep_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``gated_delta_rule_varlen_ref``, token by token: o [T, HV, Dv] in v's dtype, the state
    of each ``ssm_states[state_slots[b]]`` updated in place. Capturable in a CUDA graph: with a/b columns of the
    projection (row-strided, last dim contiguous) it launches the one kernel and no torch op. ``gated_norm``
    ``(z [T, HV, Dv], weight [Dv], eps)``: o is ``rms_norm_gated_ref(o, z, weight, eps)`` instead, in the same
    kernel (a program then holds a head's whole [Dk, Dv] state). ``keep_slots [T]`` (int, device): the state
    after token t also goes to ``ssm_states[keep_slots[t]]`` unless that is negative (kernels/gdn.py)."""
    q, k, v, a, b, A_log, dt_bias, init = _gdn_args(q, k, v, a, b, A_log, dt_bias, ssm_states, state_slots,
                                                    query_start_loc, has_initial_state)
    T, HK, dk = q.shape
    HV, dv = v.shape[1], v.shape[2]
    B = state_slots.shape[0]
    check_keep(keep_slots, T)
    if gated_norm is not None:
        z, norm_w, eps = gated_norm
        if z.shape != v.shape or z.stride(2) != 1 or norm_w.shape != (dv,):
            raise ValueError(f"gated norm z {tuple(z.shape)} / weight {tuple(norm_w.shape)} do not fit v "
                             f"{tuple(v.shape)} (z's last dim must be contiguous)")
    o = torch.empty(T, HV, dv, dtype=v.dtype, device=v.device)
    if gated_norm is not None:
        # one program a head, 4 warps: at batch 1 no slower than the split kernel plus the norm kernel, and faster
        # from batch 4 up (8 warps lose at large batches; bench/results/gdn-decode-ab-*.json)
        bv, warps, prod = pow2(dv, 16), 4, _TL_DTYPES[torch.promote_types(norm_w.dtype, v.dtype)]
        z_strides = (z.stride(0), z.stride(1))
        kernel_norm = (z, norm_w, eps)
    else:
        kernel_norm, z_strides = (o, o, 0.0), (0, 0)
        bv, warps, prod = min(32, pow2(dv, 16)), 4, _TL_DTYPES[v.dtype]
    if B == 0 or T == 0:
        return o
    _recurrent_kernel[(B, HV, triton.cdiv(dv, bv))](
        q, k, v, a, b, A_log, dt_bias, o, ssm_states, state_slots, query_start_loc, init, *kernel_norm,
        keep_slots if keep_slots is not None else state_slots, dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        o.stride(0), o.stride(1), ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), *z_strides,
        GROUP=HV // HK, DK=dk, DV=dv, DK_PAD=pow2(dk, 16), BV=bv, L2NORM=bool(use_qk_l2norm),
        NORM=gated_norm is not None, PROD_DTYPE=prod, KEEP=keep_slots is not None, num_warps=warps,
        **pdl_launch(q),
    )
    return o


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
    PROD_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    c_ok = cols < D
    mask = (rows < n_rows)[:, None] & c_ok[None, :]
    w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)  # a weight: read before the wait
    pdl_wait(PDL)  # dependent launch: kernels/triton_compat.py
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
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
        num_warps=4, **pdl_launch(x2),
    )
    return y.view(x.shape)
