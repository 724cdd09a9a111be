"""Token embedding rows as a Triton kernel, so the first kernel of a step takes part in dependent launch.

A decode step's CUDA graph starts with the embedding. As torch's kernel it cannot let the next kernel launch early,
so the first layer's projection only becomes resident, and starts streaming its weight, once the embedding has
finished; as a PDL kernel it lets it launch at once (``kernels/triton_compat.py``). The rows are copied, so the
result is bitwise ``F.embedding``'s. An id outside the table gives a row of zeros instead of a device-side assert
(ids are checked against the vocabulary when a request is admitted; this keeps a bad id from killing the process).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton_compat import jit as _jit
from kernels.triton_compat import pdl_launch, pdl_wait, tl, triton


def embedding_ref(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The oracle (raises on an id outside the table)."""
    return F.embedding(ids, weight)


@_jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, V, D, w_s0, out_s0, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (tokens, column blocks): one token's BLOCK columns."""
    pdl_wait(PDL)  # the ids may come from the kernel before (a fed or drafted token)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    token = tl.load(ids_ptr + tok).to(tl.int64)
    valid = (token >= 0) & (token < V)
    row = tl.load(w_ptr + tl.where(valid, token, 0) * w_s0 + cols, mask=mask & valid, other=0.0)
    tl.store(out_ptr + tok * out_s0 + cols, row, mask=mask)


def embedding_triton(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]`` for integer ids of any shape and a [V, D] table with contiguous rows; ids outside [0, V)
    give zero rows."""
    if ids.is_floating_point() or ids.is_complex() or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"need integer ids and a [V, D] table with contiguous rows, got ids {ids.dtype} and a table "
                         f"of shape {tuple(weight.shape)}, strides {weight.stride()}")
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    v, d = weight.shape
    out = torch.empty(flat.shape[0], d, dtype=weight.dtype, device=weight.device)
    if flat.shape[0] and d:
        block = min(triton.next_power_of_2(d), 4096)
        _embedding_kernel[(flat.shape[0], triton.cdiv(d, block))](
            flat, weight, out, v, d, weight.stride(0), out.stride(0), BLOCK=block,
            num_warps=max(1, min(block // 512, 8)), **pdl_launch(weight))
    return out.reshape(*ids.shape, d)
