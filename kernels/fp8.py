"""FP8 (e4m3) quantization: the torch references for weights scaled in blocks and for the KV cache.

A quantized weight is ``q`` (float8) with one float scale per block of ``block = (rows, cols)`` elements of its last
two dimensions; the value it stands for is ``q.float() * scale``, the scale expanded over its block. Blocks at the
tensor's edge may be partial: a ``[R, C]`` weight has a ``[ceil(R / rows), ceil(C / cols)]`` scale grid. A channel
scale is a block of ``(1, C)``, a tensor scale one block of ``(R, C)``, so one representation covers the block,
channel and tensor strategies. Leading dimensions (stacked experts) each have their own grid.

``Fp8Weight`` is one such weight as stored (a checkpoint's e4m3 bytes and scales, kept as they are): the loader hands
it on, the CUDA path keeps it in the model and the FP8 kernels read it (``fp8_linear_ref`` and the MoE reference are
their oracles); ``take_rows`` / ``take_columns`` cut it without changing a value.

The KV cache holds ``x / scale`` rounded to e4m3 with one scale per layer for K and one for V.

Invariants: quantizing clamps to +-FP8_E4M3_MAX before the cast (the cast of a larger value is NaN, e4m3fn has
no infinity); a block of zeros gets the scale 1 and stays zeros; dequantizing computes in float32 and rounds once
to the requested dtype, so an fp32 result is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK_128 = (128, 128)  # the official checkpoints' weight_block_size


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of ``shape`` in blocks of ``block`` (partial edge blocks counted)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """``scale`` [..., ceil(R / br), ceil(C / bc)] spread over each block: [..., R, C]."""
    rows, cols = shape[-2:]
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]


def dequantize_fp8_ref(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.float() * scale`` over blocks (module docstring), rounded once to ``dtype``."""
    shape = tuple(q.shape)
    out = q.float() * expand_scale(scale.float().reshape(scale_grid(shape, block)), shape, block)
    return out if dtype == torch.float32 else out.to(dtype)


def quantize_fp8_block_ref(weight: torch.Tensor, block: tuple[int, int] = BLOCK_128
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale per block) with scale = amax(|block|) / FP8_E4M3_MAX, as the official
    checkpoints store them (``weight_scale_inv``: the factor dequantization multiplies by)."""
    w = weight.float()
    *lead, rows, cols = w.shape
    grid = scale_grid(tuple(w.shape), block)
    padded = torch.zeros(*lead, grid[-2] * block[0], grid[-1] * block[1], dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w
    tiles = padded.reshape(*lead, grid[-2], block[0], grid[-1], block[1])
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (w / expand_scale(scale, tuple(w.shape), block)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


@dataclass(slots=True)
class Fp8Weight:
    """One float8 weight and its scales as stored: ``q`` float8_e4m3fn [..., rows, cols], ``scale`` float32
    [..., ceil(rows / block[0]), ceil(cols / block[1])]. The CPU path dequantizes it at load; the CUDA path keeps it."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_ref(self.q, self.scale, self.block, dtype)

    def per_row(self) -> Fp8Weight:
        """The same values with one scale row a weight row (block (1, cols)): exact, any rows can then be cut."""
        if self.block[0] == 1:
            return self
        rows = self.q.shape[-2]
        return Fp8Weight(self.q, self.scale.repeat_interleave(self.block[0], dim=-2)[..., :rows, :].contiguous(),
                         (1, self.block[1]))

    def take_rows(self, rows: torch.Tensor) -> Fp8Weight:
        """Rows ``rows`` (1-D indexes into the first dimension of a 2-D weight), in that order. The scales stay in
        blocks when the rows are whole blocks in order (the last one may be the weight's partial edge block), else
        they become one per row: the values are the stored ones either way."""
        rows = rows.to(device=self.q.device, dtype=torch.int64)
        br, total = self.block[0], self.q.shape[-2]
        if br > 1 and rows_are_blocks(rows, br, total):
            return Fp8Weight(self.q.index_select(0, rows), self.scale.index_select(0, rows[::br] // br), self.block)
        full = self.per_row()
        return Fp8Weight(self.q.index_select(0, rows), full.scale.index_select(0, rows), full.block)

    def take_columns(self, start: int, end: int) -> Fp8Weight | None:
        """Columns [start, end) of a 2-D weight, or None where they cut through a scale column (no exact form)."""
        bc, cols = self.block[1], self.q.shape[-1]
        if bc >= cols:
            return Fp8Weight(self.q[:, start:end].contiguous(), self.scale.clone(), (self.block[0], end - start))
        if start % bc or (end % bc and end != cols):
            return None
        return Fp8Weight(self.q[:, start:end].contiguous(), self.scale[:, start // bc:-(-end // bc)].contiguous(),
                         self.block)


def rows_are_blocks(rows: torch.Tensor, block_rows: int, total: int) -> bool:
    """Whether ``rows`` are whole ``block_rows``-row blocks of a ``total``-row weight, each in order (a last partial
    group must be the weight's own partial edge block)."""
    n = rows.numel()
    if n == 0:
        return False
    starts = rows[::block_rows]
    if bool((starts % block_rows).any()):
        return False
    expected = (starts[:, None] + torch.arange(block_rows, device=rows.device)[None, :]).reshape(-1)[:n]
    if not torch.equal(rows, expected):
        return False
    tail = n % block_rows
    return tail == 0 or int(starts[-1]) + tail == total


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 kernels' oracle: ``x @ dequantize(q)^T (+ bias)`` in float32, rounded once to x's dtype."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize_fp8_ref(q, scale, block), b).to(x.dtype)


def scale_tile_limit(block_cols: int, cols: int) -> int:
    """The widest power-of-two K tile that never spans two scale columns: the largest power of two dividing the
    block's width, or unbounded (``cols``'s next power of two) when one scale column covers every column."""
    if block_cols >= cols:
        return 1 << max(0, (cols - 1).bit_length())
    return block_cols & -block_cols


def fake_quantize_fp8_block_ref(weight: torch.Tensor, block: tuple[int, int] = BLOCK_128) -> torch.Tensor:
    """The weight an FP8 copy of ``weight`` stands for (quantize, then dequantize), in ``weight``'s dtype."""
    q, scale = quantize_fp8_block_ref(weight, block)
    return dequantize_fp8_ref(q, scale, block, weight.dtype)


def quantize_kv_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    """K or V rows into the fp8 cache: ``x / scale`` clamped to +-FP8_E4M3_MAX, rounded to e4m3."""
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_kv_ref(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """K or V read from the fp8 cache: ``q * scale`` in float32, rounded once to ``dtype``."""
    y = q.float() if scale == 1.0 else q.float() * scale
    return y if dtype == torch.float32 else y.to(dtype)
