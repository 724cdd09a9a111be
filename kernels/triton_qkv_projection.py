"""An attention layer's qkv projection at decode rows with its prologue in the same launch.

At one decode row (and verify rows taken as decode rows) the input norm and the qkv projection are one GEMV
(``gemv_norm_triton``) and the q/k norm, rope and KV write a second kernel that waits for it
(``kernels/triton_qkv_prologue.py``). Here the GEMV's programs run as there, each over rows of one head (the
tile's rows divide the head size); then each counts itself in on its head's counter (a k head and its v head
share one), and the last to arrive, which then sees the head's every row, runs the prologue's body for that head
(``prologue_head``) on every row and sets the counter back to zero. The operations are the prologue kernel's, so
q, k and the cache get the same bits. Heads after q, k and v (an output gate's) have no prologue.

Only where the projection runs on the Triton GEMV anyway (a weight under the TMA kernel's floor), so no faster GEMV
is traded for it. The prologue's code would raise the kernel's registers a thread (109 against the GEMV's 80 for
Qwen3-30B-A3B's [8, 512] tiles, sm_90) and cost its 640 programs their single wave, so registers are capped at what
one wave allows (96 there, no spills). ``PROLOGUE_IN_PROJECTION`` (``CONVEYOR_PROLOGUE_IN_PROJECTION=1``; read at
each call) turns it on: ``bench/b1_ablation.py`` variant ``prologue_in_projection=1`` measures it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels import triton_gemv
from kernels.triton_compat import INTERPRET, tl, triton
from kernels.triton_compat import jit as _jit
from kernels.triton_gemv import NormedProjection, _gemv_kernel, _num_sms, gemv_norm_config, gemv_norm_triton
from kernels.triton_qkv_prologue import prologue_arguments, prologue_head
from kernels.triton_rope import _rotation_pairs

PROLOGUE_IN_PROJECTION = os.environ.get("CONVEYOR_PROLOGUE_IN_PROJECTION", "0") == "1"


@dataclass(slots=True)
class QkvPrologue:
    """A step's prologue for one attention layer (``qkv_prologue_triton``'s inputs but q, k and v, which are views
    of the projection's output): heads ``num_heads`` / ``num_kv_heads`` of ``head_dim``; ``counters``: int32 zeros,
    one a q head and one a k/v pair, the layer's own."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    is_neox_style: bool
    kv_cache_layer: torch.Tensor
    slot_mapping: torch.Tensor
    rows: torch.Tensor | None
    counters: torch.Tensor


@dataclass(slots=True)
class Prologued:
    """A qkv projection whose q and k are normed and rotated and whose k and v are in the cache."""

    y: torch.Tensor


@_jit
def _norm_qkv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, k_split, x_s0, r_ptr, r_s0, nw_ptr, res_out_ptr, normed_ptr, eps,
    counters_ptr, n_k_heads,
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, rows_ptr,
    n_q_heads, head_dim, half, qk_eps,
    q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, cs_s0, cs_s1, c_slot, c_head,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_NORM: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    NORM: tl.constexpr = False, HAS_RES: tl.constexpr = False, WRITE_NORMED: tl.constexpr = False,
    WRITE_BLOCK: tl.constexpr = 16, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
    ROW_LOOP: tl.constexpr = False, K_STAGES: tl.constexpr = 1,
):
    """``_gemv_kernel``'s program, then the last program of a head to arrive runs the head's prologue."""
    _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, k_split, x_s0, r_ptr, r_s0, nw_ptr, res_out_ptr,
                 normed_ptr, eps, HAS_BIAS, SPLIT, USE_DOT, DOT_FP32, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, NORM,
                 HAS_RES, WRITE_NORMED, WRITE_BLOCK, PREFETCH, PDL, ROW_LOOP, K_STAGES)
    block = tl.program_id(0) * BLOCK_N // head_dim  # the head whose rows this program holds
    if block < n_q_heads + 2 * n_k_heads:
        is_q = block < n_q_heads
        head = tl.where(is_q, block, n_q_heads + (block - n_q_heads) % n_k_heads)  # a k head with its v head
        expected = tl.where(is_q, 1, 2) * (head_dim // BLOCK_N)
        tl.debug_barrier()  # every thread's stores issued before the program counts itself in (a release)
        arrived = tl.atomic_add(counters_ptr + head, 1, sem="acq_rel", scope="gpu")
        if arrived == expected - 1:
            for tok in range(M):
                if ROWS:
                    cs = tl.load(rows_ptr + tok).to(tl.int64) * cs_s0
                else:
                    cs = tok * cs_s0
                off_a, off_b, mask_i, cos_a, cos_b, sin_a, sin_b = _rotation_pairs(
                    cos_ptr, sin_ptr, cs, cs_s1, half, IS_NEOX, BLOCK_HALF)
                prologue_head(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, tok, head,
                              n_q_heads, head_dim, half, qk_eps, q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, c_slot, c_head,
                              off_a, off_b, mask_i, cos_a, cos_b, sin_a, sin_b, HAS_NORM, BLOCK_D)
            tl.atomic_xchg(counters_ptr + head, 0, sem="relaxed", scope="gpu")


def applies(x: torch.Tensor, weight: torch.Tensor, prologue: QkvPrologue) -> bool:
    """Whether a decode-row qkv projection of x runs its prologue in the same launch: ``PROLOGUE_IN_PROJECTION``,
    on the GPU, a weight the Triton GEMV takes (not the TMA kernel) and tiles whose rows stay within a head."""
    if not (PROLOGUE_IN_PROJECTION and x.is_cuda):
        return False
    if triton_gemv.GEMV_TMA and weight.numel() * weight.element_size() >= triton_gemv.GEMV_TMA_MIN_BYTES:
        return False
    block_n = gemv_norm_config(1, weight.shape[0], weight.shape[1], x.dtype)["block_n"]
    return prologue.head_dim % block_n == 0


def norm_qkv_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, prologue: QkvPrologue, row_loop: bool = False) -> NormedProjection:
    """``gemv_norm_triton(x, residual, norm_weight, eps, weight)`` with ``qkv_prologue_triton`` applied to its q, k
    and v (its first ``(H + 2 KVH) * D`` columns) in one launch (module docstring)."""
    m, n = x.shape[0], weight.shape[0]
    h, kvh, d = prologue.num_heads, prologue.num_kv_heads, prologue.head_dim
    q_size, kv_size = h * d, kvh * d
    if n < q_size + 2 * kv_size:
        raise ValueError(f"a projection of {n} rows has no room for {h} q and 2 x {kvh} k/v heads of {d}")
    if prologue.counters.dtype != torch.int32 or prologue.counters.shape != (h + kvh,):
        raise ValueError(f"need {h + kvh} int32 counters, got {prologue.counters.dtype} "
                         f"{tuple(prologue.counters.shape)}")
    cfg = gemv_norm_config(1, n, weight.shape[1], x.dtype)
    block_n = cfg["block_n"]
    if d % block_n:
        raise ValueError(f"tiles of {block_n} rows straddle heads of {d}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    q = y[:, :q_size].view(m, h, d)
    k = y[:, q_size:q_size + kv_size].view(m, kvh, d)
    v = y[:, q_size + kv_size:q_size + 2 * kv_size].view(m, kvh, d)
    args, constexprs = prologue_arguments(q, k, v, prologue.q_norm, prologue.k_norm, prologue.eps, prologue.cos,
                                          prologue.sin, prologue.is_neox_style, prologue.kv_cache_layer,
                                          prologue.slot_mapping, prologue.rows)
    if x.is_cuda and not INTERPRET:  # the prologue's registers must not cost the GEMV its one wave (module docstring)
        per_sm = triton.cdiv(triton.cdiv(n, block_n), _num_sms(x.device.index or 0))
        constexprs["maxnreg"] = max(64, min(255, 65536 // (per_sm * 32 * cfg["num_warps"])) // 8 * 8)
    epilogue = (_norm_qkv_kernel, (prologue.counters, kvh, *args), constexprs)
    return gemv_norm_triton(x, residual, norm_weight, eps, weight, None, False, block_n=block_n,
                            row_loop=row_loop, epilogue=epilogue, out=y)
