"""The greedy pick (argmax of each row, first index on ties) in two Triton kernels, and its torch reference.

Why: between two batch-1 decode steps the device runs the step's sampling, and every op there is a few microseconds
of launch gap on a chain that only ends when the token is on the host. torch's argmax is a memset and a reduction
kernel, and the sampler's float64 copy of the tokens one more kernel; here the rows are split over many programs
(a row of 152k logits is 600 KB) that fold their best into one int64 key a row with ``atomic_max``, and one small
kernel turns the keys into the token ids and their float64 column and resets the keys for the next call.

A key is the logit's bits made order-preserving (negative floats' magnitude bits flipped, -0 taken as +0) above the
complement of the column, so the largest key is the largest logit and, among equal logits, the lowest column:
``torch.argmax``'s answer. Max is exact and order-free: the result does not depend on which program lands first.
NaN logits (never produced by a healthy model) order above +inf when positive, as torch's NaN-wins rule would have.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton

BLOCK = 4096  # logits a program reads (16 KB of float32)
KEY_FLOOR = -(1 << 63)  # a reset key: below every logit's (int32 min << 32 in the kernel)


def greedy_pick_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64 [S], the same as float64 [S, 1]) of float logits [S, V]."""
    ids = logits.argmax(dim=-1)
    return ids, ids[:, None].double()


@_jit
def _row_best_kernel(logits_ptr, keys_ptr, V, stride, BLOCK: tl.constexpr):
    """Program (row, chunk): the chunk's best key, folded into the row's key."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # columns past V read as -inf, and their column bits rank them below every real column's -inf
    x = tl.load(logits_ptr + row * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)
    tl.atomic_max(keys_ptr + row, tl.max(key, axis=0))


@_jit
def _keys_to_tokens_kernel(keys_ptr, ids_ptr, packed_ptr, S, BLOCK: tl.constexpr):
    """The rows' columns from their keys; the keys reset for the next pick."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < S
    key = tl.load(keys_ptr + rows, mask=live, other=0)
    column = 0x7FFFFFFF - (key & 0xFFFFFFFF)
    tl.store(ids_ptr + rows, column, mask=live)
    tl.store(packed_ptr + rows, column.to(tl.float64), mask=live)
    tl.store(keys_ptr + rows, tl.full((BLOCK,), -2147483648, tl.int64) << 32, mask=live)


class GreedyPicker:
    """``greedy_pick_ref`` on the GPU. Holds the per-row keys between calls (reset by each call's second kernel),
    so calls on one stream reuse them; a larger batch grows them."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, v = logits.shape
        if v >= 1 << 31:
            raise ValueError(f"vocabulary of {v} columns does not fit the key's 31 bits")
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        if self.keys is None or self.keys.shape[0] < s or self.keys.device != logits.device:
            self.keys = torch.full((max(s, 64),), KEY_FLOOR, dtype=torch.int64, device=logits.device)
        ids = torch.empty(s, dtype=torch.int64, device=logits.device)
        packed = torch.empty(s, 1, dtype=torch.float64, device=logits.device)
        if s == 0:
            return ids, packed
        _row_best_kernel[(s, triton.cdiv(v, BLOCK))](logits, self.keys, v, logits.stride(0), BLOCK=BLOCK,
                                                      num_warps=8)
        _keys_to_tokens_kernel[(triton.cdiv(s, 128),)](self.keys, ids, packed, s, BLOCK=128, num_warps=4)
        return ids, packed
