"""FP8 weights kept as FP8 in the model (the CUDA path): the storage of a projection (``MergedLinear``) or an expert
stack (``SparseMoeBlock``'s ``w13`` / ``w2``) as float8_e4m3fn values with a float32 scale grid, filled shard by shard
from the checkpoint's ``Fp8Weight``s, and cut for expert parallelism.

A storage is ``(q [..., R, C], scale [..., ceil(R / br), ceil(C / bc)], block (br, bc))``, kernels/fp8.py's form. A
fused projection's shards (q, k, v; gate, up) share one grid: the checkpoint's 128-row blocks when every shard starts
on a block boundary, else one scale a row (``block = (1, bc)``), which holds any shard's scales exactly. A shard that
arrives in finer blocks than the storage expects turns the storage per-row first (exact: the scales are repeated).
Invariants: the stored bytes and scales are the checkpoint's own (never dequantized and quantized again); where a
tensor has no exact place (a 16-bit tensor for an FP8 shard, scale columns of another width) the module falls back
to 16 bits (``demote``), the CPU path's dequantized weights, so a load is never wrong, only larger.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.fp8 import Fp8Weight, dequantize_fp8_ref, scale_grid
from pipeline.models.quantization import Fp8Scheme


def storage_block(scheme: Fp8Scheme, sizes: list[int], cols: int) -> tuple[int, int]:
    """The scale block of a storage holding shards of ``sizes`` rows (in order) of ``cols`` columns: the scheme's
    block when every shard starts on a block row, else per row; a channel scale per row; a tensor scale one block
    for a single shard, per row for several."""
    if scheme.strategy == "block":
        assert scheme.block is not None
        rows, width = scheme.block
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return (rows if all(s % rows == 0 for s in starts) else 1), width
    if scheme.strategy == "tensor" and len(sizes) == 1:
        return sizes[0], cols
    return 1, cols


def _new_storage(shape: tuple[int, ...], block: tuple[int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    return q, torch.ones(scale_grid(shape, block), dtype=torch.float32, device=device)


def _columns_fit(storage: tuple[int, int], incoming: tuple[int, int], cols: int) -> bool:
    return storage[1] == incoming[1] or (storage[1] >= cols and incoming[1] >= cols)


def _rows_fit(storage: tuple[int, int], incoming: tuple[int, int], start: int) -> bool:
    """Whether a shard at row ``start`` in ``incoming`` blocks can go in as it is (or expanded per row)."""
    return storage[0] == 1 or (incoming[0] == storage[0] and start % storage[0] == 0)


def _write(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], start: int, w: Fp8Weight) -> None:
    """``w`` into rows [start, start + rows) of the storage (views of matching leading dimensions); its blocks fit
    (``_rows_fit`` / ``_columns_fit``)."""
    if w.block[0] != block[0]:
        w = w.per_row()
    rows = w.q.shape[-2]
    q[..., start:start + rows, :].copy_(w.q)
    grid = scale_grid(tuple(w.q.shape), w.block)
    first = start // block[0]
    scale[..., first:first + grid[-2], :].copy_(w.scale.reshape(grid))


def _check_shape(name: str, tensor: torch.Tensor | Fp8Weight, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(shape)}")


# ---- projections (MergedLinear) ----

def linear_to_fp8(linear: nn.Module, quantized_shards: int, scheme: Fp8Scheme) -> None:
    """Give ``linear`` FP8 storage for its first ``quantized_shards`` shards (before loading; the 16-bit weight is
    freed, the rows of later shards stay 16-bit as ``tail``)."""
    dense = linear.weight
    sizes = linear.out_sizes[:quantized_shards]
    nq, cols = sum(sizes), linear.in_features
    block = storage_block(scheme, sizes, cols)
    q, scale = _new_storage((nq, cols), block, dense.device)
    linear.tail = dense.data[nq:].clone() if nq < dense.shape[0] else None
    linear.weight = nn.Parameter(q, requires_grad=False)
    linear.weight_scale = scale
    linear.scale_block = block


def demote(linear: nn.Module) -> None:
    """Back to one 16-bit weight: the FP8 rows dequantized to the compute dtype (the CPU path's values)."""
    if linear.weight_scale is None:
        return
    dense = dequantize_fp8_ref(linear.weight.data, linear.weight_scale, linear.scale_block, linear.compute_dtype)
    if linear.tail is not None:
        dense = torch.cat([dense, linear.tail])
    linear.weight = nn.Parameter(dense, requires_grad=False)
    linear.weight_scale, linear.scale_block, linear.tail = None, None, None


def load_linear_shard(linear: nn.Module, shard: int | None, name: str, tensor: torch.Tensor | Fp8Weight) -> None:
    """Shard ``shard`` of ``linear`` (None: all of it) from a checkpoint tensor: FP8 bytes and scales into FP8 rows,
    16-bit values into 16-bit rows; otherwise the 16-bit form (an ``Fp8Weight`` dequantized, the module demoted)."""
    start, end = (0, sum(linear.out_sizes)) if shard is None else linear.shard_range(shard)
    _check_shape(name, tensor, (end - start, linear.in_features))
    if linear.weight_scale is not None:
        nq = linear.weight.shape[0]
        if start >= nq and linear.tail is not None:  # a shard the checkpoint keeps in 16 bits
            value = tensor.dequantize(linear.tail.dtype) if isinstance(tensor, Fp8Weight) else tensor
            linear.tail[start - nq:end - nq].copy_(value)
            return
        if isinstance(tensor, Fp8Weight) and end <= nq and _columns_fit(linear.scale_block, tensor.block,
                                                                       linear.in_features):
            if not _rows_fit(linear.scale_block, tensor.block, start):
                _rows_to_per_row(linear)
            _write(linear.weight.data, linear.weight_scale, linear.scale_block, start, tensor)
            return
        demote(linear)
    dst = linear.weight.data[start:end]
    dst.copy_(tensor.dequantize(dst.dtype) if isinstance(tensor, Fp8Weight) else tensor)


def _rows_to_per_row(linear: nn.Module) -> None:
    full = Fp8Weight(linear.weight.data, linear.weight_scale, linear.scale_block).per_row()
    linear.weight_scale, linear.scale_block = full.scale, full.block


def keep_rows(linear: nn.Module, rows: torch.Tensor) -> None:
    """Keep ``rows`` of the projection, in that order (expert parallelism's share of a layer's heads)."""
    if linear.weight_scale is None:
        linear.weight = nn.Parameter(linear.weight.index_select(0, rows), requires_grad=False)
        return
    nq = linear.weight.shape[0]
    fp8_rows = int((rows < nq).sum())
    if bool((rows[:fp8_rows] >= nq).any()) or fp8_rows == 0:  # FP8 rows must still come first: else 16 bits
        demote(linear)
        keep_rows(linear, rows)
        return
    kept = Fp8Weight(linear.weight.data, linear.weight_scale, linear.scale_block).take_rows(rows[:fp8_rows])
    linear.weight = nn.Parameter(kept.q, requires_grad=False)
    linear.weight_scale, linear.scale_block = kept.scale, kept.block
    if linear.tail is not None:
        linear.tail = linear.tail.index_select(0, rows[fp8_rows:] - nq) if fp8_rows < rows.numel() else None


def keep_columns(linear: nn.Module, start: int, end: int) -> None:
    """Keep input columns [start, end) (a row-parallel projection's share); FP8 where they are whole scale columns."""
    if linear.weight_scale is not None:
        kept = Fp8Weight(linear.weight.data, linear.weight_scale, linear.scale_block).take_columns(start, end)
        if kept is None:
            demote(linear)
        else:
            linear.weight = nn.Parameter(kept.q, requires_grad=False)
            linear.weight_scale, linear.scale_block = kept.scale, kept.block
            if linear.tail is not None:
                linear.tail = linear.tail[:, start:end].contiguous()
            return
    linear.weight = nn.Parameter(linear.weight[:, start:end].contiguous(), requires_grad=False)


# ---- expert stacks (SparseMoeBlock) ----

def moe_to_fp8(moe: nn.Module, scheme: Fp8Scheme) -> None:
    """Give ``moe`` FP8 expert stacks (before loading): ``w13`` of gate and up shards, ``w2`` of one."""
    inter, hidden = moe.intermediate_size, moe.hidden_size
    for which, sizes, cols in (("w13", [inter, inter], hidden), ("w2", [hidden], inter)):
        dense = getattr(moe, which)
        block = storage_block(scheme, sizes, cols)
        q, scale = _new_storage(tuple(dense.shape), block, dense.device)
        setattr(moe, which, nn.Parameter(q, requires_grad=False))
        setattr(moe, which + "_scale", scale)
        setattr(moe, which + "_block", block)


def demote_stack(moe: nn.Module, which: str) -> None:
    scale = getattr(moe, which + "_scale")
    if scale is None:
        return
    dense = dequantize_fp8_ref(getattr(moe, which).data, scale, getattr(moe, which + "_block"), moe.compute_dtype)
    setattr(moe, which, nn.Parameter(dense, requires_grad=False))
    setattr(moe, which + "_scale", None)
    setattr(moe, which + "_block", None)


def load_expert_rows(moe: nn.Module, which: str, experts: slice | int, start: int, name: str,
                     tensor: torch.Tensor | Fp8Weight) -> None:
    """Rows [start, start + rows) of ``which`` ("w13" / "w2") for the expert ``experts`` (or a run of them, leading
    dimension included) from a checkpoint tensor; FP8 where it fits, else the stack in 16 bits."""
    stack = getattr(moe, which)
    rows = tensor.shape[-2]
    _check_shape(name, tensor, tuple(stack.data[experts, start:start + rows].shape))
    scale, block = getattr(moe, which + "_scale"), getattr(moe, which + "_block")
    if scale is not None:
        if isinstance(tensor, Fp8Weight) and _columns_fit(block, tensor.block, stack.shape[-1]):
            if not _rows_fit(block, tensor.block, start):
                full = Fp8Weight(stack.data, scale, block).per_row()
                scale, block = full.scale, full.block
                setattr(moe, which + "_scale", scale)
                setattr(moe, which + "_block", block)
            _write(stack.data[experts], scale[experts], block, start, tensor)
            return
        demote_stack(moe, which)
        stack = getattr(moe, which)
    dst = stack.data[experts, start:start + rows]
    dst.copy_(tensor.dequantize(dst.dtype) if isinstance(tensor, Fp8Weight) else tensor)


def expert_stack(moe: nn.Module, which: str) -> torch.Tensor | Fp8Weight:
    """What the MoE kernels read: the 16-bit stack, or the FP8 one with its scales."""
    scale = getattr(moe, which + "_scale")
    stack = getattr(moe, which)
    return stack if scale is None else Fp8Weight(stack, scale, getattr(moe, which + "_block"))
