"""What the FP8 kernel tests share: the device they run on (the Triton interpreter on a CPU), seeded operands, and
the comparison with a reference (fp32: summation-order error relative to the output's magnitude; 16-bit: ulps of
it)."""
from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0,
          device: str = DEVICE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def close(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 2) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.float().abs().max().item() + 1.0
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5 * scale, rtol=1e-5)
    else:
        ulp = torch.finfo(expected.dtype).eps
        torch.testing.assert_close(actual.float(), expected.float(), atol=ulps * ulp * scale, rtol=ulps * ulp)
