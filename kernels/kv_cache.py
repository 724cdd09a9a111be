"""KV-cache write: torch reference.

Cache layout (one tensor per layer): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; index 0 is K,
1 is V; a flat slot index is ``block_id * block_size + offset``. A Triton ``write_kv`` with the same
signature sits beside this reference.

An fp8 cache (float8_e4m3fn) holds ``x / scale`` (one scale per layer for K and one for V, ``kernels/fp8.py``);
other caches hold x in their dtype and take no scale.
"""

from __future__ import annotations

import torch

from kernels.fp8 import is_fp8, quantize_kv_ref


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer."""
    return [
        torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]


def write_kv_ref(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache_layer: torch.Tensor,  # [2, NB, BS, KVH, D], contiguous
    slot_mapping: torch.Tensor,  # [T] int64, every slot valid (>= 0)
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each new token's K/V at its slot, in place (index_copy semantics); an fp8 cache gets them quantized
    with the layer's scales."""
    _, nb, bs, kvh, d = kv_cache_layer.shape
    flat = kv_cache_layer.view(2, nb * bs, kvh, d)
    if is_fp8(kv_cache_layer.dtype):  # CPU torch has no index_copy_ for float8: the same bytes through uint8
        raw = flat.view(torch.uint8)
        raw[0].index_copy_(0, slot_mapping, quantize_kv_ref(key, k_scale).view(torch.uint8))
        raw[1].index_copy_(0, slot_mapping, quantize_kv_ref(value, v_scale).view(torch.uint8))
        return
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache_layer.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache_layer.dtype))
