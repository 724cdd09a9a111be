"""SiLU-and-mul for the fused gate/up projection: Triton kernel and torch reference.

``gate_up [..., 2*I]`` holds gate in the first half and up in the second (``GatedMLP``'s ``MergedLinear``);
the result ``silu(gate) * up`` is ``[..., I]``. The kernel computes in float32 and rounds once, so in bf16 it
can differ from the reference (which rounds after silu and after the product) by an ulp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The oracle: the same ops as ``GatedMLP.forward``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@_jit
def _silu_and_mul_kernel(
    in_ptr, out_ptr, inter, in_s0, out_s0,
    BLOCK: tl.constexpr,
):
    """Grid (rows, column blocks): each program reads BLOCK gate and BLOCK up values of one row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    src = in_ptr + row * in_s0 + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g * sigmoid(g); sigmoid from exp(-|g|) <= 1 so nothing overflows for any g
    e = tl.exp(-tl.abs(gate))
    sigmoid = tl.where(gate >= 0, 1.0, e) / (1.0 + e)
    y = gate * sigmoid * up
    tl.store(out_ptr + row * out_s0 + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as ``silu_and_mul_ref``; rows may be strided, the last dim must be contiguous."""
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up last dim must be even, got {width}")
    inter = width // 2
    x = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    x2 = x.reshape(-1, width) if x.dim() != 2 else x
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 2048)
    grid = (rows, triton.cdiv(inter, block))
    num_warps = max(1, min(block // 256, 8))
    _silu_and_mul_kernel[grid](x2, out, inter, x2.stride(0), inter, BLOCK=block, num_warps=num_warps)
    return out
