"""The decode attention kernels (``kernels/triton_decode_attention.py``) against the torch reference, and with the
qkv prologue inside (``DecodePrologue``) against the prologue's reference then the attention reference (CPU: Triton
interpreter, tiny shapes; CUDA: @gpu)."""

from dataclasses import replace

import pytest
import torch

from kernels.paged_attention import plan_paged_attention
from kernels.triton_decode_attention import DecodePrologue, decode_num_splits, paged_decode_attention_triton
from kernels.triton_paged_attention import TritonAttentionPlan, paged_attention_triton
from kernels.triton_qkv_prologue import qkv_prologue_ref
from pipeline.models.rope import RotaryEmbedding
from tests.kernels.test_triton_attention import DECODE_LENS, DEVICE, make_step, reference

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
    assert decode_num_splits(1, 1, 1 << 20) == 64  # capped
    assert decode_num_splits(2, 4, 1024) == 4  # >= 256 keys per split


def prologue_step(seq_lens, *, kvh=2, group=2, d=16, rot=16, dtype=torch.float32, norm=True, neox=True, seed=0,
                  block_size=4):
    """A decode step whose q/k/v are raw (a qkv projection's views), with everything the prologue needs: the cache
    holds every earlier position, the new token's slot is free."""
    B = len(seq_lens)
    query, cache, meta = make_step([1] * B, seq_lens, kvh=kvh, group=group, d=d, block_size=block_size,
                                   dtype=dtype, seed=seed)
    cache = cache.to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    qkv = torch.randn(B, (kvh * group + 2 * kvh) * d, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, : kvh * group * d].view(B, kvh * group, d)
    k = qkv[:, kvh * group * d : (kvh * group + kvh) * d].view(B, kvh, d)
    v = qkv[:, (kvh * group + kvh) * d :].view(B, kvh, d)
    weights = [(1 + 0.2 * torch.randn(d, generator=gen)).to(dtype).to(DEVICE) for _ in range(2)] if norm else [None] * 2
    rope = RotaryEmbedding(d, rot, 4096, 10000.0, is_neox_style=neox, dtype=dtype, device=DEVICE)
    cos, sin = rope.cos_sin(torch.tensor([s - 1 for s in seq_lens], device=DEVICE))
    prologue = DecodePrologue(k, v, weights[0], weights[1], 1e-6, cos, sin, neox, meta.slot_mapping)
    return qkv, q, cache, meta, prologue


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm,neox,rot", [(True, True, 16), (False, True, 8), (True, False, 16), (True, True, 8)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_with_the_prologue_inside_equals_prologue_then_attention(dtype, norm, neox, rot, num_splits):
    """The decode kernel with the prologue inside (``DecodePrologue``) against the prologue kernel's reference then
    the attention: the same output and the same cache (the new K/V written once, by the program holding it)."""
    lens = [1, 7, 16, 33]  # the new token alone, mid-block, at a block's end, in the last of several splits
    plan = TritonAttentionPlan(num_splits=num_splits, decode_block_n=16)
    qkv, q, cache, meta, p = prologue_step(lens, dtype=dtype, norm=norm, neox=neox, rot=rot)
    out = paged_decode_attention_triton(q, cache, meta, 0.3, plan, prologue=p)
    qkv_ref, q_ref, cache_ref, _, p_ref = prologue_step(lens, dtype=dtype, norm=norm, neox=neox, rot=rot)
    qkv_prologue_ref(q_ref, p_ref.key, p_ref.value, p_ref.q_norm, p_ref.k_norm, p_ref.eps, p_ref.cos, p_ref.sin,
                     neox, cache_ref, meta.slot_mapping)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cache.float(), cache_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), reference(q_ref, cache_ref, meta, 0.3), atol=tol, rtol=tol)
    assert torch.equal(qkv, prologue_step(lens, dtype=dtype, norm=norm, neox=neox, rot=rot)[0])  # inputs untouched


def test_decode_prologue_padding_row_writes_nothing():
    qkv, q, cache, meta, p = prologue_step([5, 9])
    slots = meta.slot_mapping.clone()
    slots[1] = -1
    before = cache.clone()
    paged_decode_attention_triton(q, cache, meta, 0.3, TritonAttentionPlan(num_splits=2, decode_block_n=16),
                                  prologue=replace(p, slot_mapping=slots))
    changed = (cache != before).reshape(2, -1, *cache.shape[3:]).any(-1).any(-1).any(0).nonzero().flatten().tolist()
    assert changed == [int(meta.slot_mapping[0])]  # row 0's new slot only


@pytest.mark.gpu
@pytest.mark.parametrize("d,group", [(128, 4), (64, 1), (96, 8), (256, 2)])
def test_gpu_decode_bf16(d, group):
    seq_lens = [1, 15, 16, 17, 300, 1000, 4097, 2222]
    query, cache, meta = make_step([1] * 8, seq_lens, kvh=4, group=group, d=d, block_size=16,
                                   dtype=torch.bfloat16, device="cuda")
    ref = reference(query, cache, meta, d**-0.5)
    for plan in (None, TritonAttentionPlan(num_splits=1), TritonAttentionPlan(num_splits=7)):
        out = paged_decode_attention_triton(query, cache, meta, d**-0.5, plan)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
