"""An fp8 (e4m3) KV cache in the Triton kernels: the store's rounding and the host side of both directions.

Store: ``e4m3_bits`` turns K or V into the bytes ``kernels/fp8.py``'s ``quantize_kv_ref`` writes (``x / scale`` with
IEEE division in fp32, clamped to +-FP8_E4M3_MAX, rounded to the nearest e4m3 value, ties to even: torch's cast). The
rounding is spelt out on the fp32 bits instead of left to Triton's cast, so the interpreter (whose float8 downcast
rounds half up and lets a rounded-up mantissa land on the wrong value) and the GPU store the same bytes; the kernels
store them through a uint8 view of the cache (``store_view``).

Read: e4m3 values are exact in bf16, fp16 and fp32, so the attention kernels convert a loaded tile to the query's
dtype unchanged and apply the layer's scales where they are linear: ``k_scale`` times the score scale (``q . k``
is linear in k) and ``v_scale`` times each program's output (``p @ v`` is linear in v). Both are fp32 multiplies of
per-layer constants, fixed for the layer's lifetime, so a CUDA graph captures them as they are.

Invariant: a 16-bit cache takes neither (``read_scales`` gives 1 and 1, and the kernels skip the output multiply
under their ``KV_FP8`` constexpr), so its results keep their bits.
"""

from __future__ import annotations

import torch

from kernels.fp8 import is_fp8
from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl

@_jit
def e4m3_bits(x, scale):
    """uint8 e4m3fn codes of ``x / scale``: fp32 IEEE division, clamp to +-448, round to nearest, ties to even
    (a NaN of either sign gives the NaN code 0x7F)."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    nan = y != y
    y = tl.minimum(tl.maximum(tl.where(nan, 0.0, y), -448.0), 448.0)  # FP8_E4M3_MAX; a NaN's code comes last
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    mag = bits & 0x7FFFFFFF  # |y| <= 448: the sums below stay far from overflow
    # normal (|y| >= 2^-6): keep 3 of the 23 mantissa bits, the other 20 rounded to nearest even; a carry out of the
    # mantissa moves into the exponent, which is the next e4m3 value up; 960 rebiases the exponent from 127 to 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    # subnormal (|y| < 2^-6): the number of 2^-9 steps, (mantissa with its leading 1) >> (141 - exponent) rounded to
    # nearest even; 8 steps is the code of 2^-6. Shifts stop at 31 (fp32 zeros and subnormals round to 0).
    shift = tl.minimum(141 - (mag >> 23), 31)
    full = (mag & 0x7FFFFF) | 0x800000
    steps = full >> shift
    rest = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    steps += ((rest > half) | ((rest == half) & ((steps & 1) == 1))).to(tl.int32)
    code = tl.where(mag < 0x3C800000, steps, normal) | sign  # 0x3C800000: the fp32 bits of 2^-6
    return tl.where(nan, 0x7F, code).to(tl.uint8)


def is_fp8_kv(cache: torch.Tensor) -> bool:
    return is_fp8(cache.dtype)


def store_view(cache: torch.Tensor) -> torch.Tensor:
    """What a KV-writing kernel stores through: the bytes of an fp8 cache (``e4m3_bits``), any other cache itself."""
    if cache.dtype == torch.float8_e5m2:
        raise ValueError("the Triton KV kernels store e4m3 (float8_e4m3fn) caches only")
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def read_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """(k_scale, v_scale) an attention kernel applies: the layer's for an fp8 cache, (1, 1) for any other."""
    if not is_fp8(cache.dtype):
        return 1.0, 1.0
    if cache.dtype != torch.float8_e4m3fn:
        raise ValueError("the Triton attention kernels read e4m3 (float8_e4m3fn) caches only")
    return float(k_scale), float(v_scale)
