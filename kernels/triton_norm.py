"""RMSNorm (optionally fused with the residual add): Triton kernel and torch reference.

Semantics are ``RMSNorm.forward`` in ``pipeline/models/layers.py``: with a residual, ``new_residual = x + residual``
is rounded to the input dtype first, then normalized in float32, multiplied by the weight in float32 and cast
back (exactly what ``F.rms_norm`` does). Inputs may be ``[..., N]`` with any leading dims (per-head q/k norm
passes ``[T, heads, D]`` views into the fused qkv output); the last dim must be contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton_compat import pdl_launch, pdl_wait
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``, or ``(norm(x + residual), x + residual)``: the oracle, same ops as ``RMSNorm.forward``."""
    shape = (x.shape[-1],)
    if residual is not None:
        residual = x + residual
    y = residual if residual is not None else x
    if weight.dtype != y.dtype:  # an fp32 weight (zero-centred norms hold 1 + w): fp32 math, one rounding
        out = F.rms_norm(y.float(), shape, weight.float(), eps).to(y.dtype)
    else:
        out = F.rms_norm(y, shape, weight, eps)
    return out if residual is None else (out, residual)


@_jit
def _rms_norm_kernel(
    x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr,
    inner, n_cols, eps,
    x_s0, x_s1, r_s0, r_s1,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per row; row = (i, j) of a [A, B, N] view, so strided 3-D views need no copy.

    The outputs are contiguous: row ``i * inner + j`` starts at ``row * n_cols``."""
    pdl_wait(PDL)  # dependent launch: kernels/triton_compat.py
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
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xf * rstd * w
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(t', s0, s1)`` addressing row (i, j) of ``t`` seen as [A, B, N] at ``i*s0 + j*s1``, without views
    (this runs per call: host overhead matters); only >3-D inputs are reshaped."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() > 3:
        t = t.reshape(-1, t.shape[-2], t.shape[-1])
    if t.dim() == 3:
        return t, t.stride(0), t.stride(1)
    return t, (t.stride(0) if t.dim() == 2 else 0), 0


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
    out_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    new_residual = None if residual is None else torch.empty(x.shape, dtype=out_dtype, device=x.device)
    xr, x_s0, x_s1 = _rows(x)
    inner = xr.shape[-2] if xr.dim() == 3 else 1
    rows = xr.numel() // n if n else 0
    if rows == 0:
        return out if residual is None else (out, new_residual)
    rr, r_s0, r_s1 = _rows(residual) if residual is not None else (xr, 0, 0)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        xr, rr, out, new_residual if residual is not None else out, weight.contiguous(),
        inner, n, eps,
        x_s0, x_s1, r_s0, r_s1,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block,
        num_warps=_num_warps(block), **pdl_launch(x),
    )
    return out if residual is None else (out, new_residual)
