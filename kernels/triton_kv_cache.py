"""KV-cache write with padding slots skipped: Triton kernel and torch references.

Layout as in ``kernels/kv_cache.py``: ``[2, NB, BS, KVH, D]``, slot = ``block * BS + offset``. CUDA graphs run
at padded batch sizes, so the padding tokens carry slot ``-1`` and must write nothing; ``write_kv_ref`` has no
such rule, ``write_kv_padded_ref`` adds it. key/value may be strided views (``[T, KVH, D]`` slices of a fused
qkv output) as long as the last dim is contiguous. An fp8 cache gets ``x / scale`` rounded to e4m3 with the layer's
``k_scale`` / ``v_scale``, the bytes ``write_kv_ref`` writes (``kernels/triton_fp8_kv.py``).
"""

from __future__ import annotations

import torch

from kernels.kv_cache import write_kv_ref

from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton
from kernels.triton_fp8_kv import e4m3_bits, is_fp8_kv, store_view


def write_kv_padded_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache_layer: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """``write_kv_ref`` for the tokens whose slot is >= 0 (the others are padding)."""
    if slot_mapping.numel() == 0:
        return
    valid = slot_mapping >= 0
    if bool(valid.all()):
        write_kv_ref(key, value, kv_cache_layer, slot_mapping, k_scale, v_scale)
    else:
        write_kv_ref(key[valid], value[valid], kv_cache_layer, slot_mapping[valid], k_scale, v_scale)


@_jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    n_heads, head_dim,
    k_s0, k_s1, v_s0, v_s1, c_slot, c_head, k_scale, v_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    """One program per token: copy its [KVH, D] key and value tiles to the slot (nothing for slot < 0). KV_FP8: the
    cache pointers are its bytes, the tiles stored as ``e4m3_bits`` with the layer's scales."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < n_heads)[:, None] & (dims < head_dim)[None, :] & valid
    k = tl.load(key_ptr + tok * k_s0 + heads[:, None] * k_s1 + dims[None, :], mask=mask)
    v = tl.load(value_ptr + tok * v_s0 + heads[:, None] * v_s1 + dims[None, :], mask=mask)
    dst = slot * c_slot + heads[:, None] * c_head + dims[None, :]
    if KV_FP8:
        tl.store(k_cache_ptr + dst, e4m3_bits(k, k_scale), mask=mask)
        tl.store(v_cache_ptr + dst, e4m3_bits(v, v_scale), mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache_layer: torch.Tensor,  # [2, NB, BS, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int64; < 0 = padding, skipped
    k_scale: float = 1.0,  # an fp8 cache's scales (the layer's, fixed: a CUDA graph captures them)
    v_scale: float = 1.0,
) -> None:
    """Same contract as ``write_kv_padded_ref``, in place, one launch for K and V."""
    t, kvh, d = key.shape
    if value.shape != key.shape or slot_mapping.shape != (t,):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)}, slots {tuple(slot_mapping.shape)}")
    if kv_cache_layer.shape[-2:] != (kvh, d):
        raise ValueError(f"cache {tuple(kv_cache_layer.shape)} does not hold [{kvh}, {d}] heads")
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if t == 0:
        return
    _, nb, bs, _, _ = kv_cache_layer.shape
    flat = store_view(kv_cache_layer).view(2, nb * bs, kvh, d)  # raises for a cache whose slots are not one axis
    k_cache, v_cache = flat[0], flat[1]
    if k_cache.stride(-1) != 1:
        raise ValueError("kv cache last dim must be contiguous")
    _write_kv_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),
        kvh, d,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
        float(k_scale), float(v_scale),
        BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_D=triton.next_power_of_2(d),
        KV_FP8=is_fp8_kv(kv_cache_layer),
        num_warps=4,
    )
