"""The fused MoE kernels on FP8 expert stacks (``Fp8Weight``: float8 [E, rows, cols] with a scale grid per expert):
the decode kernels (kernels/triton_moe_decode.py) and the grouped GEMMs (kernels/triton_moe.py) against the fp8
reference (``fused_moe_ref`` on the dequantized experts): 128 x 128 blocks with partial edges (H and I not multiples
of 128), per-row and per-tensor scales, bf16 and fp32 activations, a 16-bit w13 beside an FP8 w2, and expert
parallelism (slots routed to other ranks' experts add nothing).

On CPU the kernels run under the Triton interpreter on tiny shapes; the gpu tests run the Qwen3.5-35B-A3B expert
shapes (256 experts and the folded shared expert, H 2048, I 512, top-8).
"""

from __future__ import annotations

import pytest
import torch

from kernels.dispatch import rows_as_decode
from kernels.fp8 import Fp8Weight, quantize_fp8_block_ref
from kernels.moe import DECODE_SLOTS, fused_moe, fused_moe_ref, route_topk_ref
from kernels.triton_moe import fused_moe_triton
from kernels.triton_moe_decode import fused_moe_decode_triton
from tests.kernels.fp8_checks import DEVICE, close, randn

H, I, E, K = 200, 72, 5, 3


def stacks(kind: str, experts: int = E, hidden: int = H, inter: int = I, device: str = DEVICE):
    """(w13, w2) FP8 stacks in ``kind`` blocks: "block" 128 x 128, "row" one scale a row, "tensor" one an expert."""
    blocks = {"block": ((128, 128), (128, 128)), "row": ((1, 128), (1, inter)),
              "tensor": ((2 * inter, hidden), (hidden, inter))}[kind]
    w13 = randn(experts, 2 * inter, hidden, seed=1, scale=hidden ** -0.5, device=device)
    w2 = randn(experts, hidden, inter, seed=2, scale=inter ** -0.5, device=device)
    return tuple(Fp8Weight(*quantize_fp8_block_ref(w, block), block) for w, block in zip((w13, w2), blocks))


def routing(t: int, experts: int, k: int, seed: int = 3, device: str = DEVICE):
    gen = torch.Generator().manual_seed(seed)
    weights, ids = route_topk_ref(torch.randn(t, experts, generator=gen), k, True)
    return weights.to(device), ids.to(device)


@pytest.mark.parametrize("dtype,t,kind,configs", [
    (torch.float32, 1, "block", None), (torch.bfloat16, 3, "block", None), (torch.float32, 2, "row", None),
    (torch.bfloat16, 1, "tensor", None),
    (torch.float32, 2, "block", ((8, 64, 4, 1), (16, 32, 2), 3))])  # three K tiles a step (a ragged last one)
def test_fp8_decode_moe(dtype, t, kind, configs):
    w13, w2 = stacks(kind)
    x = randn(t, H, dtype=dtype, seed=4)
    tw, ids = routing(t, E + 2, K)  # ids E and E + 1: another rank's experts
    kw = {} if configs is None else {"gate_up_config": configs[0], "down_config": configs[1],
                                     "gate_up_k_sub": configs[2]}
    close(fused_moe_decode_triton(x, w13, w2, tw, ids, 0, E, **kw), fused_moe_ref(x, w13, w2, tw, ids, 0, E))


@pytest.mark.parametrize("dtype,t,kind", [(torch.float32, 6, "block"), (torch.bfloat16, 5, "row"),
                                          (torch.float32, 4, "tensor")])
def test_fp8_grouped_moe(dtype, t, kind):
    w13, w2 = stacks(kind)
    x = randn(t, H, dtype=dtype, seed=5)
    tw, ids = routing(t, E + 2, K)
    offset_ids = ids + 2  # this rank holds experts [2, 2 + E): ids 0 and 1 are another rank's
    close(fused_moe_triton(x, w13, w2, tw, offset_ids, 2, E), fused_moe_ref(x, w13, w2, tw, offset_ids, 2, E))


def test_fp8_and_16bit_stacks_mix():
    """A stack the checkpoint kept in 16 bits beside an FP8 one (each kernel reads its own weight's form); on the CPU
    ``fused_moe`` is the reference."""
    w13, w2 = stacks("block")
    dense13 = w13.dequantize(torch.float32)
    x = randn(2, H, seed=6)
    tw, ids = routing(2, E, K)
    want = fused_moe_ref(x, dense13, w2, tw, ids)
    close(fused_moe_decode_triton(x, dense13, w2, tw, ids), want)
    close(fused_moe_ref(x, w13, w2, tw, ids), fused_moe_ref(x, dense13, w2.dequantize(torch.float32), tw, ids))
    if DEVICE == "cpu":
        assert torch.equal(fused_moe(x.cpu(), w13, w2, tw.cpu(), ids.cpu()), fused_moe_ref(x, w13, w2, tw, ids))


def test_fp8_moe_tiles_span_scale_columns():
    """A gate/up K tile of two scale columns (each chunk's scale multiplies x under it) gives the same values; a
    down K tile past one scale column, or rows that straddle scale rows, are refused by name."""
    w13, w2 = stacks("block")
    x = randn(1, H, seed=7)
    tw, ids = routing(1, E, K)
    got = fused_moe_decode_triton(x, w13, w2, tw, ids, gate_up_config=(8, 256, 4), down_config=(4, 128, 4))
    close(got, fused_moe_ref(x, w13, w2, tw, ids))
    with pytest.raises(ValueError, match="down BLOCK_K 256"):
        fused_moe_decode_triton(x, w13, w2, tw, ids, down_config=(4, 256, 4))
    with pytest.raises(ValueError, match="gate_up BLOCK_N 16"):
        fused_moe_decode_triton(x, *stacks("row"), tw, ids, gate_up_config=(16, 128, 4))


QWEN35 = dict(experts=257, hidden=2048, inter=512)  # 256 routed + the folded shared expert


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 16])
def test_gpu_fp8_decode_moe_qwen35_shapes(t):
    w13, w2 = stacks("block", device="cuda", **QWEN35)
    x = randn(t, 2048, dtype=torch.bfloat16, seed=8, device="cuda")
    tw, ids = routing(t, 256, 8, device="cuda")
    shared = torch.full((t, 1), 256, dtype=ids.dtype, device="cuda")  # the shared expert's slot on every token
    tw, ids = torch.cat([tw, torch.full_like(tw[:, :1], 0.5)], 1), torch.cat([ids, shared], 1)
    expected = fused_moe_ref(x, w13, w2, tw, ids)
    close(fused_moe_decode_triton(x, w13, w2, tw, ids), expected)
    if ids.numel() > DECODE_SLOTS:  # the grouped kernels' rows: no per-token bits
        return
    with rows_as_decode():  # each token as a one-token step computes it, bit for bit
        rows = fused_moe(x, w13, w2, tw, ids)
    assert torch.equal(rows, torch.cat([fused_moe(x[i:i + 1], w13, w2, tw[i:i + 1], ids[i:i + 1])
                                        for i in range(t)]))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 512])
def test_gpu_fp8_grouped_moe_qwen35_shapes(t):
    w13, w2 = stacks("block", device="cuda", **QWEN35)
    x = randn(t, 2048, dtype=torch.bfloat16, seed=9, device="cuda")
    tw, ids = routing(t, 256, 8, device="cuda")
    close(fused_moe_triton(x, w13, w2, tw, ids), fused_moe_ref(x, w13, w2, tw, ids))
    close(fused_moe(x, w13, w2, tw, ids), fused_moe_ref(x, w13, w2, tw, ids))
