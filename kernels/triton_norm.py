"""RMSNorm (optionally fused with the residual add): Triton kernel and torch reference.

Semantics are ``RMSNorm.forward`` in ``pipeline/models/layers.py``: with a residual, ``new_residual = x + residual``
is rounded to the input dtype first, then normalized in float32, multiplied by the weight in float32 and cast
back (exactly what ``F.rms_norm`` does). Inputs may be ``[..., N]`` with any leading dims (per-head q/k norm
passes ``[T, heads, D]`` views into the fused qkv output); the last dim must be contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # CPU-only installs: the reference still imports; the kernel is never launched
    triton = tl = None

    def _jit(fn):
        return fn


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``, or ``(norm(x + residual), x + residual)``: the oracle, same ops as ``RMSNorm.forward``."""
    shape = (x.shape[-1],)
    if residual is None:
        return F.rms_norm(x, shape, weight, eps)
    residual = x + residual
    return F.rms_norm(residual, shape, weight, eps), residual


@_jit
def _rms_norm_kernel(
    x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr,
    inner, n_cols, eps,
    x_s0, x_s1, r_s0, r_s1, o_s0, o_s1, ro_s0, ro_s1,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per row; rows are addressed as (i, j) of a [A, B, N] view so strided 3-D views need no copy."""
    row = tl.program_id(0).to(tl.int64)
    i = row // inner
    j = row % inner
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + i * x_s0 + j * x_s1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + i * r_s0 + j * r_s1 + cols, mask=mask, other=0.0)
        # round the sum to the residual dtype first, as the torch add does, and normalize that rounded value
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + i * ro_s0 + j * ro_s1 + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xf * rstd * w
    tl.store(out_ptr + i * o_s0 + j * o_s1 + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [A, B, N] without copying where possible (last dim made contiguous)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _num_warps(block: int) -> int:
    """About one 16-byte vector per thread per pass; 1 warp for a head_dim row, 8 for a 4096-wide hidden row."""
    return max(1, min(block // 512, 16))


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``rms_norm_ref``; outputs are new contiguous tensors shaped like ``x``."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match the last dim {n}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    weight = weight.contiguous()
    x3 = _as_3d(x)
    rows = x3.shape[0] * x3.shape[1]
    out_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    o3 = _as_3d(out)
    if residual is not None:
        r3 = _as_3d(residual)
        new_residual = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        ro3 = _as_3d(new_residual)
    else:
        r3 = ro3 = o3  # never read or written (HAS_RESIDUAL=False)
    if rows == 0:
        return out if residual is None else (out, new_residual)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x3, r3, o3, ro3, weight,
        x3.shape[1], n, eps,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        o3.stride(0), o3.stride(1), ro3.stride(0), ro3.stride(1),
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block,
        num_warps=_num_warps(block),
    )
    return out if residual is None else (out, new_residual)
