"""Triton paged attention against the torch reference (CPU: Triton interpreter, tiny shapes; CUDA: @gpu)."""

import math
import os
import time

import pytest
import torch

from kernels.kv_cache import allocate_kv_cache, write_kv_ref
from kernels.paged_attention import paged_attention_ref
from kernels.triton_decode_attention import paged_decode_attention_triton
from kernels.triton_paged_attention import TritonAttentionPlan, paged_attention_triton, paged_prefill_attention_triton
from pipeline.models.attention import build_attention_metadata

# Compiled Triton kernels take CUDA tensors only; the interpreter (conftest sets it without a GPU) runs on CPU.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"
SMALL = TritonAttentionPlan(decode_block_n=16, prefill_block_m=16, prefill_block_n=16)  # several tiles per sequence


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def make_step(q_lens, seq_lens, *, kvh=2, group=2, d=16, block_size=4, dtype=torch.float32, seed=0,
              device=DEVICE, spare=3):
    """A paged cache filled through write_kv_ref along shuffled block tables; unassigned blocks (block 0, where
    padded table entries point, included) hold large garbage that would show if read unmasked."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    nb = 1 + sum(need) + spare
    ids = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    tables = [ids[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    cache = allocate_kv_cache(1, nb, block_size, kvh, d, dtype, device)[0]
    cache.copy_(1e3 * torch.randn(cache.shape, generator=gen))
    whole = build_attention_metadata(seq_lens, seq_lens, tables, block_size, device)  # every position's slot
    T = sum(seq_lens)
    keys = torch.randn(T, kvh, d, generator=gen).to(device)
    values = torch.randn(T, kvh, d, generator=gen).to(device)
    write_kv_ref(keys, values, cache, whole.slot_mapping)
    meta = build_attention_metadata(q_lens, seq_lens, tables, block_size, device)
    query = torch.randn(sum(q_lens), kvh * group, d, generator=gen).to(device=device, dtype=dtype)
    return query, cache, meta


def reference(query, cache, meta, scale):
    """The torch reference in float32 (the oracle for 16-bit kernels too)."""
    return paged_attention_ref(query.float(), cache.float(), meta, scale)


DECODE_LENS = [1, 7, 16, 33, 70]  # a length-1 context, lengths off the block size, splits of 16..32 keys

PREFILL_CASES = [
    ([9], [9]),  # a whole prompt
    ([17, 5], [17, 5]),  # several prompts, tiles straddling sequences
    ([20], [45]),  # a chunk after a cached prefix
    ([3, 1, 18, 1, 1], [3, 20, 40, 2, 70]),  # mixed: decode tokens around prefill chunks
]


@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_matches_ref(case, group, block_size):
    q_lens, seq_lens = PREFILL_CASES[case]
    query, cache, meta = make_step(q_lens, seq_lens, group=group, block_size=block_size, seed=case)
    out = paged_prefill_attention_triton(query, cache, meta, 0.35, SMALL)
    torch.testing.assert_close(out, reference(query, cache, meta, 0.35), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_prefill_kv_splits_match_ref(case, splits):
    """Keys split into parts of whole 16-key tiles (some splits past a row's position, some empty for short
    sequences), partials combined by the reduce kernel: the unsplit result."""
    q_lens, seq_lens = PREFILL_CASES[case]
    query, cache, meta = make_step(q_lens, seq_lens, group=2, block_size=4, seed=30 + case)
    plan = TritonAttentionPlan(prefill_block_m=16, prefill_block_n=16, prefill_splits=splits)
    out = paged_prefill_attention_triton(query, cache, meta, 0.35, plan)
    torch.testing.assert_close(out, reference(query, cache, meta, 0.35), atol=1e-5, rtol=1e-5)


def test_prefill_num_splits():
    from kernels.triton_paged_attention import PREFILL_MAX_SPLITS, prefill_num_splits

    assert prefill_num_splits(8, 8192, 132) == 8  # 16 tokens after an 8k prefix: 8 keys-splits of 1,024
    assert prefill_num_splits(8, 40960, 132) == PREFILL_MAX_SPLITS
    assert prefill_num_splits(132, 40960, 132) == 1  # the tiles fill the GPU in one wave
    assert prefill_num_splits(408, 31936, 132) == 4  # 3.09 waves: 4 of them unsplit, 3.25 split in 4
    assert prefill_num_splits(2056, 8192, 132) == 1  # 15.6 waves: splitting evens out nothing
    assert prefill_num_splits(408, 1600, 132) == 1  # a short context is not split
    assert prefill_num_splits(8, 900, 132) == 1  # short contexts: no split under PREFILL_SPLIT_KEYS


def test_prefill_default_tiles_and_dispatch():
    query, cache, meta = make_step([3, 1, 18], [3, 20, 40], group=4, block_size=16, seed=7)
    assert not meta.is_decode_only
    torch.testing.assert_close(paged_attention_triton(query, cache, meta, 0.2), reference(query, cache, meta, 0.2),
                               atol=1e-5, rtol=1e-5)


def test_prefill_kernel_serves_decode_batches():
    query, cache, meta = make_step([1] * 3, [1, 19, 40], group=2, block_size=4, seed=3)
    dec = paged_decode_attention_triton(query, cache, meta, 0.3, TritonAttentionPlan(num_splits=2, decode_block_n=16))
    torch.testing.assert_close(paged_prefill_attention_triton(query, cache, meta, 0.3, SMALL), dec,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decode", [True, False])
def test_16bit_inputs_accumulate_in_fp32(dtype, decode):
    q_lens = [1, 1, 1] if decode else [4, 1, 20]
    query, cache, meta = make_step(q_lens, [9, 40, 30], group=2, block_size=4, dtype=dtype, seed=11)
    plan = TritonAttentionPlan(num_splits=2, decode_block_n=16, prefill_block_m=16, prefill_block_n=16)
    out = paged_attention_triton(query, cache, meta, 0.25, plan)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(query, cache, meta, 0.25), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,num_splits", [([1] * 5, 1), ([1] * 5, 3), ([1, 2, 3, 1, 1], 2)])
def test_output_gate_equals_torch_gate(q_lens, num_splits, dtype):
    """Qwen3-Next's output gate fused into the decode stores (direct and after the split reduce) and applied after
    the prefill kernel: equal to ``out * torch.sigmoid(gate)`` on the ungated output (the gate a strided view)."""
    query, cache, meta = make_step(q_lens, DECODE_LENS, group=2, block_size=4, dtype=dtype, seed=21)
    gen = torch.Generator().manual_seed(22)
    rows = torch.randn(query.shape[0], 2 * query[0].numel(), generator=gen).to(device=DEVICE, dtype=dtype)
    gate = rows[:, query[0].numel():].view(query.shape)
    plan = TritonAttentionPlan(num_splits=num_splits, decode_block_n=16, prefill_block_m=16, prefill_block_n=16)
    gated = paged_attention_triton(query, cache, meta, 0.3, plan, gate)
    expected = paged_attention_triton(query, cache, meta, 0.3, plan) * torch.sigmoid(gate)
    ulp = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(gated.float(), expected.float(), atol=1e-6 + ulp, rtol=1e-5 + ulp)
    if meta.is_decode_only:
        with pytest.raises(ValueError, match="gate"):
            paged_decode_attention_triton(query, cache, meta, 0.3, plan, gate[:, :1])


@pytest.mark.parametrize("d", [80, 64])
def test_head_dim_padding_and_strided_query(d):
    """head_dim 80 pads to 128 under masks; the query is a strided view into a packed qkv projection."""
    query, cache, meta = make_step([5, 1], [12, 30], kvh=1, group=2, d=d, block_size=16, seed=d)
    packed = torch.zeros(query.shape[0], 4, d, device=query.device)
    packed[:, :2] = query
    view = packed[:, :2]
    assert not view.is_contiguous()
    ref = reference(query, cache, meta, 0.2)
    torch.testing.assert_close(paged_prefill_attention_triton(view, cache, meta, 0.2, SMALL), ref,
                               atol=1e-5, rtol=1e-5)
    dq, dc, dm = make_step([1, 1], [12, 30], kvh=1, group=2, d=d, block_size=16, seed=d)
    torch.testing.assert_close(paged_decode_attention_triton(dq, dc, dm, 0.2, TritonAttentionPlan(num_splits=2)),
                               reference(dq, dc, dm, 0.2), atol=1e-5, rtol=1e-5)


# ---- CUDA: bigger shapes in bf16 against the fp32 reference (skipped without a device) ----

@pytest.mark.gpu
@pytest.mark.parametrize("d,group", [(128, 4), (64, 1), (80, 2), (256, 8)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_prefill_bf16(d, group, block_size):
    q_lens, seq_lens = [1, 700, 1, 333, 1024, 5], [50, 700, 3000, 1333, 1024, 5]
    query, cache, meta = make_step(q_lens, seq_lens, kvh=2, group=group, d=d, block_size=block_size,
                                   dtype=torch.bfloat16, device="cuda")
    out = paged_attention_triton(query, cache, meta, d**-0.5)
    torch.testing.assert_close(out.float(), reference(query, cache, meta, d**-0.5), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_fp32_is_not_tf32():
    query, cache, meta = make_step([1, 64], [500, 600], kvh=2, group=4, d=128, block_size=16, device="cuda")
    out = paged_attention_triton(query, cache, meta, 0.1)
    torch.testing.assert_close(out, reference(query, cache, meta, 0.1), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_bench_runs():
    from bench.kernel_attention import bench_decode_attention, bench_prefill_attention

    start = time.perf_counter()
    dec = bench_decode_attention(batch_size=8, context_len=1024, iters=3)
    pre = bench_prefill_attention(num_seqs=2, prompt_len=512, iters=3)
    assert dec["max_abs_err"] < 2e-2 and dec["gbps"] > 0
    assert pre["max_abs_err"] < 2e-2 and pre["tflops"] > 0
    assert time.perf_counter() - start < 120

