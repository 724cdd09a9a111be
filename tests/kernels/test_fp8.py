"""FP8 references (kernels/fp8.py) and the fp8 KV cache: block quantization with partial edge blocks, channel and
tensor scales in the same representation, the KV write quantizing with the layer's scales, and every attention path
(decode, prefill, a mixed varlen step) reading the fp8 cache as the same attention over its dequantized values."""
import math

import pytest
import torch

from kernels.fp8 import (BLOCK_128, FP8_E4M3_MAX, dequantize_fp8_ref, dequantize_kv_ref, expand_scale,
                         fake_quantize_fp8_block_ref, quantize_fp8_block_ref, quantize_kv_ref, scale_grid)
from kernels.kv_cache import write_kv_ref
from kernels.paged_attention import paged_attention_ref, plan_paged_attention
from kernels.triton_kv_cache import write_kv_padded_ref
from pipeline.models.attention import build_attention_metadata

pytestmark = pytest.mark.usefixtures("single_torch_thread")

E4M3_RELATIVE_STEP = 2.0 ** -3  # 3 mantissa bits: neighbouring e4m3 values differ by at most this relative step


@pytest.mark.parametrize("shape", [(200, 160), (64, 200), (128, 256), (3, 160, 72)])
def test_block_quantization_partial_blocks(shape):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=gen)
    w[..., :5, :7] = 0.0  # most of a block zero: its scale still comes from the block's largest value
    q, scale = quantize_fp8_block_ref(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert tuple(scale.shape) == scale_grid(shape, BLOCK_128)
    rows, cols = shape[-2:]
    for i in range(math.ceil(rows / 128)):
        for j in range(math.ceil(cols / 128)):
            tile = w[..., i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = tile.abs().amax(dim=(-2, -1))
            torch.testing.assert_close(scale[..., i, j], amax / FP8_E4M3_MAX, rtol=0, atol=0)
    back = dequantize_fp8_ref(q, scale, BLOCK_128)
    bound = expand_scale(scale, shape, BLOCK_128) * FP8_E4M3_MAX * E4M3_RELATIVE_STEP / 2  # half a step at the top
    assert bool(((back - w).abs() <= bound + 1e-12).all())
    assert q.float().abs().amax() == FP8_E4M3_MAX  # each block's largest value lands on 448
    torch.testing.assert_close(fake_quantize_fp8_block_ref(w), back, rtol=0, atol=0)


def test_zero_block_and_dtypes():
    w = torch.zeros(130, 130, dtype=torch.bfloat16)
    w[129, 129] = 3.0
    q, scale = quantize_fp8_block_ref(w)
    assert scale[0, 0] == 1.0 and scale[1, 1] == 3.0 / FP8_E4M3_MAX
    out = dequantize_fp8_ref(q, scale, BLOCK_128, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, w)


def test_channel_and_tensor_scales_are_blocks():
    gen = torch.Generator().manual_seed(1)
    q = (torch.randn(6, 10, generator=gen) * 50).to(torch.float8_e4m3fn)
    channel = torch.rand(6, 1, generator=gen) + 0.5
    torch.testing.assert_close(dequantize_fp8_ref(q, channel, (1, 10)), q.float() * channel, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_fp8_ref(q, channel.reshape(6), (1, 10)), q.float() * channel, rtol=0, atol=0)
    tensor = torch.tensor([0.25])
    torch.testing.assert_close(dequantize_fp8_ref(q, tensor, (6, 10)), q.float() * 0.25, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_fp8_ref(q, tensor.reshape(()), (6, 10)), q.float() * 0.25, rtol=0, atol=0)


def test_kv_quantize_clamps_and_scales():
    x = torch.tensor([1.0, -2.0, 1000.0, -1e6, 0.3])
    q = quantize_kv_ref(x, 2.0)
    assert q.dtype == torch.float8_e4m3fn and not q.float().isnan().any()
    torch.testing.assert_close(q.float()[:3], torch.tensor([0.5, -1.0, FP8_E4M3_MAX]))
    assert q.float()[3] == -FP8_E4M3_MAX
    torch.testing.assert_close(dequantize_kv_ref(q, 2.0, torch.float32)[:2], torch.tensor([1.0, -2.0]))


def test_fp8_kv_write_and_padded_write():
    gen = torch.Generator().manual_seed(2)
    nb, bs, kvh, d, T = 6, 4, 2, 8, 9
    cache = torch.zeros(2, nb, bs, kvh, d, dtype=torch.float8_e4m3fn)
    k, v = torch.randn(T, kvh, d, generator=gen), torch.randn(T, kvh, d, generator=gen)
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    write_kv_ref(k, v, cache, slots, 0.5, 2.0)
    flat = cache.view(2, nb * bs, kvh, d)
    assert torch.equal(flat[0, slots].view(torch.uint8), quantize_kv_ref(k, 0.5).view(torch.uint8))
    assert torch.equal(flat[1, slots].view(torch.uint8), quantize_kv_ref(v, 2.0).view(torch.uint8))
    padded = torch.zeros_like(cache)
    write_kv_padded_ref(k, v, padded, torch.where(torch.arange(T) % 2 == 0, slots, -1), 0.5, 2.0)
    even = slots[::2]
    assert torch.equal(padded.view(2, -1, kvh, d)[:, even].view(torch.uint8), flat[:, even].view(torch.uint8))
    assert int(padded.view(torch.uint8).count_nonzero()) == int(flat[:, even].view(torch.uint8).count_nonzero())


@pytest.mark.parametrize("q_lens,seq_lens", [([1, 1, 1], [5, 12, 1]), ([7], [7]), ([3, 1, 6], [10, 9, 6])])
def test_every_attention_path_reads_the_fp8_cache(q_lens, seq_lens):
    """Attention over an fp8 cache equals attention over a float32 cache holding its dequantized values, for a
    decode-only step, a whole prompt and a mixed varlen step (chunks after a cached prefix beside decode rows)."""
    gen = torch.Generator().manual_seed(3)
    bs, kvh, group, d = 4, 2, 2, 8
    tables, nb, next_block = [], 1, 1
    for s in seq_lens:
        count = math.ceil(s / bs)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    nb = next_block + 1
    cache = torch.zeros(2, nb, bs, kvh, d, dtype=torch.float8_e4m3fn)
    k_scale, v_scale = 0.02, 0.05
    meta = build_attention_metadata(q_lens, seq_lens, tables, bs)
    all_slots = build_attention_metadata(seq_lens, seq_lens, tables, bs).slot_mapping
    k = torch.randn(len(all_slots), kvh, d, generator=gen) * 3
    v = torch.randn(len(all_slots), kvh, d, generator=gen)
    write_kv_ref(k, v, cache, all_slots, k_scale, v_scale)
    dequantized = torch.stack([dequantize_kv_ref(cache[0], k_scale, torch.float32),
                               dequantize_kv_ref(cache[1], v_scale, torch.float32)])
    query = torch.randn(sum(q_lens), kvh * group, d, generator=gen)
    got = paged_attention_ref(query, cache, meta, d ** -0.5, plan_paged_attention(meta, bs), k_scale, v_scale)
    want = paged_attention_ref(query, dequantized, meta, d ** -0.5, plan_paged_attention(meta, bs))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
