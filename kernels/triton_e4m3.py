"""e4m3 weights to float32 by moving bits, not through the conversion units.

An float8_e4m3fn byte is a sign bit, 4 exponent bits (bias 7) and 3 mantissa bits. Moved into a float32 word with the
sign on top and the 7 other bits at the top of the exponent-and-mantissa field, it is the float32 encoding of the
e4m3 value times 2^-120 (float32's exponent bias is 127): exactly, for every finite byte, e4m3 subnormals landing on
float32 subnormals (the kernels' float32 multiplies keep subnormals). Two integer operations an element, where the
hardware path takes an e4m3x2 to f16x2 conversion and an f16 to f32 one, on units that run at a fraction of the
ALUs' rate: a decode GEMV streaming FP8 weights at memory speed converts several weights a clock per SM.

The caller multiplies the shifted value by ``scale * e4m3_half_shift()`` (the product stays far from float32's ends
for any scale a checkpoint holds) and its accumulated result by ``e4m3_half_shift()`` once: powers of two, so the
result has the bits of ``value * scale`` then the same sums. The byte 0x7F (e4m3 NaN, which quantizing never writes)
reads as the finite 480.
"""
from __future__ import annotations

from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl

E4M3_HALF_SHIFT = 2.0 ** 60  # the two halves of 2^120, each applied once (see the module docstring)


@_jit
def e4m3_half_shift():
    """``E4M3_HALF_SHIFT`` inside a kernel (a jit function sees no module floats)."""
    return 1152921504606846976.0


@_jit
def e4m3_to_f32_shifted(w):
    """float32 ``w * 2^-120`` of an e4m3 tensor, exactly, by integer moves."""
    b = w.to(tl.uint8, bitcast=True).to(tl.uint32)
    return (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
