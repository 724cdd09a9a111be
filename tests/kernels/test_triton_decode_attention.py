"""The decode attention kernels (``kernels/triton_decode_attention.py``) against the torch reference (CPU: Triton
interpreter, tiny shapes; CUDA: @gpu)."""

import pytest
import torch

from kernels.paged_attention import plan_paged_attention
from kernels.triton_decode_attention import decode_num_splits, paged_decode_attention_triton
from kernels.triton_paged_attention import TritonAttentionPlan, paged_attention_triton
from tests.kernels.test_triton_attention import DECODE_LENS, make_step, reference

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_ref(num_splits, group, block_size):
    query, cache, meta = make_step([1] * 5, DECODE_LENS, group=group, block_size=block_size, seed=group)
    assert meta.is_decode_only
    plan = TritonAttentionPlan(num_splits=num_splits, decode_block_n=16)
    out = paged_decode_attention_triton(query, cache, meta, 0.3, plan)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out, reference(query, cache, meta, 0.3), atol=1e-5, rtol=1e-5)


def test_decode_many_splits_and_default_plan():
    query, cache, meta = make_step([1, 1], [70, 5], group=2, block_size=16, seed=5)
    ref = reference(query, cache, meta, 0.25)
    for plan in (TritonAttentionPlan(num_splits=9, decode_block_n=16), None, plan_paged_attention(meta, 16)):
        torch.testing.assert_close(paged_attention_triton(query, cache, meta, 0.25, plan), ref, atol=1e-5, rtol=1e-5)


def test_decode_split_heuristic():
    assert decode_num_splits(256, 8, 8192) == 1  # B * KVH fills the GPU already
    assert decode_num_splits(4, 8, 100) == 1  # short contexts: one split, no reduce
    assert decode_num_splits(1, 8, 32768) == 33  # ~2 waves over 132 SMs
    assert decode_num_splits(1, 1, 1 << 20) == 128  # capped
    assert decode_num_splits(2, 4, 1024) == 4  # >= 256 keys per split

@pytest.mark.gpu
@pytest.mark.parametrize("d,group", [(128, 4), (64, 1), (96, 8), (256, 2)])
def test_gpu_decode_bf16(d, group):
    seq_lens = [1, 15, 16, 17, 300, 1000, 4097, 2222]
    query, cache, meta = make_step([1] * 8, seq_lens, kvh=4, group=group, d=d, block_size=16,
                                   dtype=torch.bfloat16, device="cuda")
    ref = reference(query, cache, meta, d**-0.5)
    for plan in (None, TritonAttentionPlan(num_splits=1), TritonAttentionPlan(num_splits=7),
                 TritonAttentionPlan(num_splits=128)):  # the cap: the reduce runs 8 warps at head_dim 256
        out = paged_decode_attention_triton(query, cache, meta, d**-0.5, plan)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
