"""Masking the logits of the grammar-constrained rows with their token bitmasks, in one Triton kernel, and its
torch reference.

Why: a step's bitmask holds only the rows a grammar constrains ([N, ceil(V/32)] int32, bit j of word w allows token
32w + j), copied to the device once. Unpacking it with torch ops makes int32 and bool tensors of [N, V] and masks the
whole batch; the kernel reads each packed word once and writes -inf only where a bit is 0, for the named rows, and
leaves every other row untouched. Row ``slots[i]`` of the bitmask masks logits row ``rows[i]``.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton

BLOCK = 4096  # logits a program masks (128 words of its row's bitmask)
NEG_INF = float("-inf")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [N, V]: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                            slots: torch.Tensor) -> torch.Tensor:
    """The oracle: logits[rows[i], t] = -inf where bitmask[slots[i]] does not allow t; in place, returns logits."""
    if len(rows):
        rows, slots = rows.long(), slots.long()
        allowed = unpack_bitmask(bitmask[slots], logits.shape[-1])
        logits[rows] = logits[rows].masked_fill(~allowed, NEG_INF)
    return logits


@_jit(do_not_specialize=["vocab_size"])
def _apply_bitmask_kernel(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, num_words, rows_ptr, slots_ptr,
                          vocab_size, BLOCK: tl.constexpr):
    """Program (i, chunk): BLOCK logits of row rows[i], masked by the matching words of bitmask row slots[i]."""
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    words = chunk * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    packed = tl.load(bitmask_ptr + slot * bitmask_stride + words, mask=words < num_words, other=-1)
    refused = ((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
    columns = chunk * BLOCK + tl.arange(0, BLOCK)
    tl.store(logits_ptr + row * logits_stride + columns, float("-inf"),
             mask=(columns < vocab_size) & tl.reshape(refused, (BLOCK,)))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                               slots: torch.Tensor) -> torch.Tensor:
    """``apply_token_bitmask_ref`` on the GPU: one launch for every constrained row, in place."""
    count, vocab = len(rows), logits.shape[-1]
    if count == 0:
        return logits
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError("the logits and the bitmask need contiguous rows")
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[-1]} words cannot mask {vocab} tokens")
    _apply_bitmask_kernel[(count, triton.cdiv(vocab, BLOCK))](logits, logits.stride(0), bitmask, bitmask.stride(0),
                                                               bitmask.shape[-1], rows, slots, vocab, BLOCK=BLOCK,
                                                               num_warps=4)
    return logits
