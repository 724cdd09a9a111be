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


def prologue_case(norm: bool, neox: bool, rot: int, d: int = 16, kvh: int = 2, group: int = 4, seed: int = 7,
                  dtype=torch.float32, device="cpu", seq_lens=(1, 7, 16, 33, 70)):
    """A decode step with raw q/k/v as the qkv projection leaves them, its cos/sin and norm weights; the last
    row is padding (slot -1: no KV write)."""
    from kernels.triton_decode_attention import DecodePrologue

    query, cache, meta = make_step([1] * len(seq_lens), list(seq_lens), kvh=kvh, group=group, d=d, block_size=4,
                                   seed=seed, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    B = len(seq_lens)
    k, v = (torch.randn(B, kvh, d, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    angles = torch.rand(B, 1, rot // 2, generator=gen) * 6.0
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(device=device, dtype=dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(device=device, dtype=dtype)
    weights = [(torch.rand(d, generator=gen) + 0.5).to(device=device, dtype=dtype) for _ in range(2)] if norm \
        else [None, None]
    slots = meta.slot_mapping.clone()
    slots[-1] = -1
    return query, cache, meta, DecodePrologue(k, v, weights[0], weights[1], 1e-6, cos, sin, neox, slots)


@pytest.mark.parametrize("norm,neox,rot", [(True, True, 16), (False, True, 16), (True, False, 16), (True, True, 8),
                                           (False, False, 6)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_with_fused_prologue_equals_prologue_then_decode(norm, neox, rot, num_splits):
    """The decode kernel doing the prologue's work: the same cache as the prologue kernel (the step's keys and
    values written, the padding row's not) and the same output as that kernel followed by the plain decode kernel,
    and as the torch references. One split puts the step's key of the 70-token row in a later tile than the first
    (read back from the cache)."""
    from kernels.triton_qkv_prologue import qkv_prologue_triton

    query, cache, meta, pro = prologue_case(norm, neox, rot)
    plan = TritonAttentionPlan(num_splits=num_splits, decode_block_n=16)
    ref_q, ref_k, ref_cache = query.clone(), pro.k.clone(), cache.clone()
    qkv_prologue_triton(ref_q, ref_k, pro.v, pro.q_norm, pro.k_norm, pro.eps, pro.cos, pro.sin, pro.is_neox_style,
                        ref_cache, pro.slot_mapping)
    expected = paged_decode_attention_triton(ref_q, ref_cache, meta, 0.3, plan)
    fused_cache = cache.clone()
    out = paged_decode_attention_triton(query.clone(), fused_cache, meta, 0.3, plan, prologue=pro)
    assert torch.equal(fused_cache, ref_cache)
    torch.testing.assert_close(out[:-1], expected[:-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:-1], reference(ref_q, ref_cache, meta, 0.3)[:-1], atol=1e-5, rtol=1e-5)


def test_fused_prologue_checks_its_operands():
    query, cache, meta, pro = prologue_case(True, True, 16)
    pro.k_norm = None
    with pytest.raises(ValueError, match="normed together"):
        paged_decode_attention_triton(query, cache, meta, 0.3, None, prologue=pro)
    with pytest.raises(ValueError, match="decode-only"):
        q2, c2, m2 = make_step([3], [5], seed=1)
        paged_attention_triton(q2, c2, m2, 0.3, None, None, prologue=pro)


@pytest.mark.gpu
@pytest.mark.parametrize("d,group,rot,norm", [(128, 8, 128, True), (256, 8, 64, True), (128, 4, 128, False)])
def test_gpu_decode_with_fused_prologue(d, group, rot, norm):
    """bf16 at the model shapes (Qwen3: head_dim 128 with q/k norm; Qwen3.5: 256 with 64 rotary dims): the cache
    equals the prologue kernel's, the output the prologue kernel followed by the plain decode kernel's."""
    from kernels.triton_qkv_prologue import qkv_prologue_triton

    query, cache, meta, pro = prologue_case(norm, True, rot, d=d, kvh=4, group=group, dtype=torch.bfloat16,
                                            device="cuda", seq_lens=(1, 15, 16, 17, 300, 1000, 4097, 2222))
    ref_q, ref_k, ref_cache = query.clone(), pro.k.clone(), cache.clone()
    qkv_prologue_triton(ref_q, ref_k, pro.v, pro.q_norm, pro.k_norm, pro.eps, pro.cos, pro.sin, True, ref_cache,
                        pro.slot_mapping)
    for plan in (None, TritonAttentionPlan(num_splits=1), TritonAttentionPlan(num_splits=66)):
        expected = paged_decode_attention_triton(ref_q, ref_cache, meta, d**-0.5, plan)
        fused_cache = cache.clone()
        out = paged_decode_attention_triton(query.clone(), fused_cache, meta, d**-0.5, plan, prologue=pro)
        assert torch.equal(fused_cache, ref_cache)
        torch.testing.assert_close(out[:-1].float(), expected[:-1].float(), atol=2e-2, rtol=2e-2)
