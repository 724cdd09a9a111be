"""The causal depthwise conv of Gated DeltaNet in Triton: same contract as ``kernels.gdn.causal_conv1d_varlen_ref``
(the oracle; its module docstring has the varlen layout and the state slots).

Two kernels, picked by the host from the step's longest row (``max_query_len``):

* ``_conv_update_kernel`` (every row at most one token: decode, CUDA-graph captured), grid ``(B, C / BLOCK_C)``:
  row b's token is ``x[qsl[b]]``, so no program searches for its sequence. A program reads its channels' K-1
  window and the token, writes the output, then (after a CTA barrier: the shifted window is re-read from memory
  by other threads) the window shifted by one.
* ``_conv_varlen_kernel`` (prompt chunks, any mix), grid ``(T // BLOCK_T + B, C / BLOCK_C)``: a program is one tile
  of BLOCK_T tokens of one sequence (device-side search over ``query_start_loc``, as the paged-attention prefill)
  and a block of channels. BLOCK_T >= K-1, so only a sequence's first tile needs its previous inputs: that program
  alone reads the slot's old window (for its outputs and for the new window, whose older entries survive when the
  chunk is shorter than K-1), passes a CTA barrier, then writes the new window. No other program touches the slot.

Prompt tiles are 8 tokens by 256 channels (512 B of each token row, so a program's loads coalesce). The window is
stored ``[slot, C, K-1]``; the state is rounded to x's dtype where it is read, as the reference does.

Keep slots (``keep_slots [T]``, speculative verify rows; kernels/gdn.py): the window after token t is the conv's
own inputs for token t, less the oldest. Both kernels hold those already (the varlen kernel loads input j of every
token of its tile in its tap loop, old window entries included in the first tile; the decode kernel builds the
new window), so they store them to ``keep_slots[t]`` where they have them: no extra launch and no extra read.
Keep slots are nobody's own slot, so these stores race with no read of the old windows.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import pdl_launch, pdl_wait
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton
from kernels.triton_gdn import check_keep, check_varlen, pow2
from kernels.triton_paged_attention import find_sequence

DECODE_ROW_TOKENS = 16  # as_decode_rows: rows of up to this many tokens (a speculative verify row)


@_jit(do_not_specialize=["num_seqs"])
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, slots_ptr, qsl_ptr, init_ptr, y_ptr, keep_ptr, num_seqs, C,
    stride_xt, stride_yt, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk,
    K: tl.constexpr, KM1_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, KEEP: tl.constexpr = False,
):
    tile = tl.program_id(0)
    b = find_sequence(qsl_ptr, num_seqs, tile, BLOCK_T)
    lo = tl.load(qsl_ptr + b)
    length = tl.load(qsl_ptr + b + 1) - lo
    t0 = (tile - (lo // BLOCK_T + b)) * BLOCK_T
    if t0 >= length:  # a spare tile; an empty sequence keeps its state (as the GDN reference does)
        return
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    rows = t0 + tl.arange(0, BLOCK_T)
    r_ok = rows < length
    init = tl.load(init_ptr + b) != 0
    st = state_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_ss + cols * stride_sc
    x_base = x_ptr + lo.to(tl.int64) * stride_xt
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if KEEP:  # each token's keep slot (-1: none): its window is its taps 1..K-1, stored as entries 0..K-2
        keep = tl.load(keep_ptr + (lo + rows).to(tl.int64), mask=r_ok, other=-1).to(tl.int64)
        keep_ptrs = state_ptr + keep[:, None] * stride_ss + cols[None, :] * stride_sc
        keep_mask = (keep >= 0)[:, None] & c_ok[None, :]
    for j in tl.static_range(K):
        p = rows - (K - 1) + j  # input position in the sequence; p < 0: previous input K-1+p of the state
        inp = tl.load(x_base + p[:, None] * stride_xt + cols[None, :], mask=((p >= 0) & r_ok)[:, None] & c_ok[None, :],
                      other=0.0).to(tl.float32)
        if t0 < K - 1:  # only a sequence's first tile reaches back into the window
            old = tl.load(st[None, :] + (K - 1 + p)[:, None] * stride_sk,
                          mask=((p < 0) & r_ok & init)[:, None] & c_ok[None, :], other=0.0)
            inp += old.to(x_ptr.dtype.element_ty).to(tl.float32)  # the reference casts the state to x's dtype
        if KEEP:
            if j > 0:  # inp holds x-dtype values: one rounding to the state's dtype, as the reference
                tl.store(keep_ptrs + (j - 1) * stride_sk, inp.to(state_ptr.dtype.element_ty), mask=keep_mask)
        w = tl.load(w_ptr + cols * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
        acc += inp * w[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + (lo + rows).to(tl.int64)[:, None] * stride_yt + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=r_ok[:, None] & c_ok[None, :])
    if K > 1:
        if t0 == 0:  # the first tile owns the slot: new state = the last K-1 of [old state, the sequence's inputs]
            jj = tl.arange(0, KM1_PAD)
            pos = length - (K - 1) + jj  # new names: inside an scf.if a name may not change its shape
            m = c_ok[:, None] & (jj < K - 1)[None, :]
            from_x = tl.load(x_base + pos[None, :] * stride_xt + cols[:, None], mask=m & (pos >= 0)[None, :],
                             other=0.0)
            kept = tl.load(st[:, None] + (K - 1 + pos)[None, :] * stride_sk, mask=m & (pos < 0)[None, :] & init,
                           other=0.0)
            sd = state_ptr.dtype.element_ty
            new_state = tl.where((pos >= 0)[None, :], from_x.to(sd), kept.to(x_ptr.dtype.element_ty).to(sd))
            tl.debug_barrier()  # every read of the old state (above and in the outputs) happens before the write
            tl.store(st[:, None] + jj[None, :] * stride_sk, new_state, mask=m)


@_jit(do_not_specialize=["token"])
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, slots_ptr, qsl_ptr, init_ptr, y_ptr, keep_ptr, C, token,
    stride_xt, stride_yt, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk,
    K: tl.constexpr, KM1_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr,
    KEEP: tl.constexpr = False, PDL: tl.constexpr = False, EARLY: tl.constexpr = True,
):
    """Token ``token`` of each row (0 for decode; a verify row's tokens one launch each, ``rows_as_decode``):
    its output from the window in the row's slot, then the window moved on by it. EARLY (a row's first token): the
    window, written by an earlier step, is read before the wait; a later token's window is the one the launch
    before this one wrote, so a later token's launch waits first."""
    if not EARLY:
        pdl_wait(PDL)  # dependent launch: kernels/triton_compat.py
    b = tl.program_id(0)
    t = tl.load(qsl_ptr + b) + token
    empty = tl.load(qsl_ptr + b + 1) - t <= 0  # an empty row (or one shorter than token + 1) keeps its state
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    jj = tl.arange(0, KM1_PAD)
    j_ok = jj < K - 1
    # The window (written by an earlier step), the slot and bounds (host copies) and the weights may be read
    # before the wait; only the token's input comes from the kernel this one waits on.
    init = (tl.load(init_ptr + b) != 0) | (token > 0)  # after the row's first token its slot holds its window
    st = (state_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_ss + cols[:, None] * stride_sc
          + jj[None, :] * stride_sk)
    m = c_ok[:, None] & j_ok[None, :]
    window = tl.load(st, mask=m & init, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_C, KM1_PAD]
    # the new window: entries 1..K-2 of the old one, then x. Entry j + 1 is re-read from memory (no register shuffle
    # across threads), issued with the other loads; the barrier below orders every read before any write
    shifted = tl.load(st + stride_sk, mask=m & (jj < K - 2)[None, :] & init, other=0.0)
    w_win = tl.load(w_ptr + cols[:, None] * stride_wc + jj[None, :] * stride_wk, mask=m, other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + cols * stride_wc + (K - 1) * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
    if EARLY:
        pdl_wait(PDL)  # every program waits, before it writes or exits
    if empty:
        return
    x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + cols, mask=c_ok, other=0.0)
    acc = tl.sum(window * w_win, 1) + x.to(tl.float32) * w_last
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + t.to(tl.int64) * stride_yt + cols, acc.to(y_ptr.dtype.element_ty), mask=c_ok)
    if K > 1:
        sd = state_ptr.dtype.element_ty
        new_window = tl.where((jj == K - 2)[None, :], x.to(sd)[:, None], shifted.to(x_ptr.dtype.element_ty).to(sd))
        if KEEP:  # the token's kept window is the new one
            keep = tl.load(keep_ptr + t.to(tl.int64)).to(tl.int64)
            tl.store(state_ptr + keep * stride_ss + cols[:, None] * stride_sc + jj[None, :] * stride_sk, new_window,
                     mask=m & (keep >= 0))
        tl.debug_barrier()
        tl.store(st, new_window, mask=m)


def causal_conv1d_varlen_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
    state_slots: torch.Tensor, query_start_loc: torch.Tensor, has_initial_state: torch.Tensor,
    activation: str | None = "silu", max_query_len: int | None = None, keep_slots: torch.Tensor | None = None,
    as_decode_rows: bool = False,
) -> torch.Tensor:
    """Same contract as ``causal_conv1d_varlen_ref``: y [T, C] in x's dtype; ``conv_states [num_slots, C, K-1]``
    updated in place. x may be a row-strided view (last dim contiguous); y is contiguous. An empty sequence (which
    the reference cannot take) leaves its slot alone. ``max_query_len`` (host): 1 takes the decode kernel; None or
    more the varlen one; ``as_decode_rows`` with rows of up to 16 tokens: the decode kernel once for each token
    position, so every token's output and window are bitwise a one-token step's (kernels/dispatch.py
    rows_as_decode). ``keep_slots [T]`` (int, device): the window after token t also goes to
    ``conv_states[keep_slots[t]]`` unless that is negative, in the same kernel launch."""
    if activation not in ("silu", None):
        raise ValueError(f"activation {activation!r} is not supported")
    T, C = x.shape
    K = weight.shape[1]
    if weight.shape != (C, K) or not 1 <= K <= 9 or conv_states.shape[1:] != (C, K - 1):
        raise ValueError(f"weight {tuple(weight.shape)} / conv_states {tuple(conv_states.shape)} do not fit x "
                         f"{tuple(x.shape)}")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit {C} channels")
    init = check_varlen(state_slots, query_start_loc, has_initial_state)
    check_keep(keep_slots, T)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    B = state_slots.shape[0]
    if B == 0:
        return y
    strides = (x.stride(0), y.stride(0), weight.stride(0), weight.stride(1), conv_states.stride(0),
               conv_states.stride(1), conv_states.stride(2) if K > 1 else 1)
    common = dict(K=K, KM1_PAD=pow2(K - 1), HAS_BIAS=bias is not None, SILU=activation == "silu",
                  KEEP=keep_slots is not None)
    b_arg = bias if bias is not None else weight
    keep_arg = keep_slots if keep_slots is not None else state_slots
    block_c = min(pow2(C, 16), 256)  # 512 B of each 16-bit token row
    if max_query_len is not None and (max_query_len <= 1 or as_decode_rows and max_query_len <= DECODE_ROW_TOKENS):
        for token in range(max(1, max_query_len)):  # a later token's window is the one the launch before wrote
            _conv_update_kernel[(B, triton.cdiv(C, block_c))](
                x, weight, b_arg, conv_states, state_slots, query_start_loc, init, y, keep_arg, C, token, *strides,
                **common, BLOCK_C=block_c, num_warps=2, EARLY=token == 0, **pdl_launch(x))
        return y
    # short tiles (K-1 must fit in one) of 512 B rows: the best of a sweep over 8-64 tokens x 64-512 channels x 4/8
    # warps on 16 prompts of 512 tokens at the Qwen3.5-35B-A3B width (bench/results/gdn-conv-grouping-sweep-*.json)
    block_t = max(pow2(K - 1), min(8, pow2(-(-T // B))), 4)
    _conv_varlen_kernel[(T // block_t + B, triton.cdiv(C, block_c))](
        x, weight, b_arg, conv_states, state_slots, query_start_loc, init, y, keep_arg, B, C, *strides,
        **common, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    return y
