"""The one-program expert grouping (``kernels/triton_moe_grouping.py``) equals ``kernels.moe.group_by_expert``
bit for bit: sorted slots, block experts and the padded length, with non-local slots, idle experts, an expert
every token picks, and sizes from one slot to a full decode batch of 256 tokens x 8."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.moe import group_by_expert
from kernels.triton_compat import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"

pytestmark = [pytest.mark.skipif(triton is None or DEVICE == "cpu" and not INTERPRET,
                                 reason="needs triton (GPU or TRITON_INTERPRET=1)"),
              pytest.mark.usefixtures("single_torch_thread")]


@pytest.mark.parametrize("t,k,n_experts,block_m,offset", [
    (1, 2, 8, 16, 0), (17, 2, 8, 16, 0), (33, 4, 8, 4, 0), (40, 3, 6, 16, 2), (9, 2, 4, 1, 0),
    (256, 9, 257, 16, 0), (64, 8, 128, 32, 128),
])
def test_matches_torch_grouping(t, k, n_experts, block_m, offset):
    from kernels.triton_moe_grouping import group_by_expert_triton

    gen = torch.Generator().manual_seed(t * 7 + k)
    ids = torch.randint(0, n_experts + offset + 2, (t, k), generator=gen, dtype=torch.int32)  # some non-local
    ids[:, 0] = offset  # one expert chosen by every token
    ids = ids.to(DEVICE)
    mine = group_by_expert_triton(ids, n_experts, block_m, offset)
    ref = group_by_expert(ids, n_experts, block_m, offset)
    for got, want in zip(mine, ref):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_rejects_sizes_it_cannot_hold():
    from kernels.triton_moe_grouping import MAX_SLOTS, group_by_expert_triton

    with pytest.raises(ValueError):
        group_by_expert_triton(torch.zeros(MAX_SLOTS + 1, 1, dtype=torch.int32, device=DEVICE), 8, 16)
    with pytest.raises(ValueError):
        group_by_expert_triton(torch.zeros(4, 2, dtype=torch.int32, device=DEVICE), 0, 16)
