"""The bit-moving e4m3 read (kernels/triton_e4m3.py): every finite byte gives its value times 2^-120 exactly, and
the two half shifts give the value back."""
from __future__ import annotations

import os

import pytest
import torch

from kernels.triton_compat import tl, triton
from kernels.triton_e4m3 import E4M3_HALF_SHIFT, e4m3_half_shift, e4m3_to_f32_shifted

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
pytestmark = pytest.mark.skipif(triton is None or (DEVICE == "cpu" and not INTERPRET),
                                reason="needs triton (GPU or TRITON_INTERPRET=1)")

if triton is not None:
    @triton.jit
    def _read(w_ptr, shifted_ptr, back_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        shifted = e4m3_to_f32_shifted(tl.load(w_ptr + offs))
        tl.store(shifted_ptr + offs, shifted)
        tl.store(back_ptr + offs, shifted * e4m3_half_shift() * e4m3_half_shift())


def test_every_finite_byte_reads_as_its_value_shifted():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    w = codes.view(torch.float8_e4m3fn).to(DEVICE)
    shifted = torch.empty(256, dtype=torch.float32, device=DEVICE)
    back = torch.empty_like(shifted)
    _read[(1,)](w, shifted, back, N=256)
    finite = ~torch.isnan(w.float())
    value = w.float()[finite].double()
    assert E4M3_HALF_SHIFT == 2.0 ** 60
    assert torch.equal(shifted[finite].double(), value * 2.0 ** -120)  # subnormals and both zeros included
    assert torch.equal(back[finite].double(), value)
    assert torch.equal(torch.signbit(shifted[finite]), torch.signbit(w.float()[finite]))
