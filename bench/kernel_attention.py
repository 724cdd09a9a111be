"""Microbenchmarks of the Triton paged-attention kernels on CUDA (imports fine on CPU; call only with a GPU).

Each function builds a random paged cache with shuffled block tables, checks the kernel once against the fp32
torch reference, times ``iters`` launches with CUDA events and returns a dict: decode reports the achieved
bandwidth (K/V bytes read / time), prefill the causal TFLOP/s (4 * D * H * sum over new tokens of the keys
each attends to, i.e. 4*T*S*H*D/2 for whole prompts).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kernels.paged_attention import paged_attention_ref
from kernels.triton_decode_attention import decode_num_splits, paged_decode_attention_triton
from kernels.triton_paged_attention import TritonAttentionPlan, paged_prefill_attention_triton
from pipeline.models.attention import build_attention_metadata


def _random_step(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    nb = sum(need) + 1
    ids = (torch.randperm(nb - 1) + 1).tolist()
    tables = [ids[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    cache = torch.randn(2, nb, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    meta = build_attention_metadata(q_lens, seq_lens, tables, block_size, "cuda")
    query = torch.randn(sum(q_lens), num_heads, head_dim, device="cuda", dtype=dtype, generator=gen)
    return query, cache, meta


def cuda_time_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Mean ms per call of `fn` on the current CUDA stream, timed with events after `warmup` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _max_err(out: torch.Tensor, query, cache, meta, scale) -> float:
    ref = paged_attention_ref(query.float(), cache.float(), meta, scale)
    return (out.float() - ref).abs().max().item()


def bench_decode_attention(
    batch_size: int = 64, context_len: int = 4096, num_heads: int = 32, num_kv_heads: int = 8,
    head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
    num_splits: int | None = None, iters: int = 50, warmup: int = 5, check: bool = True,
) -> dict:
    """Decode step of ``batch_size`` sequences of ``context_len`` keys: time, GB/s of K/V read, error vs ref."""
    query, cache, meta = _random_step([1] * batch_size, [context_len] * batch_size, num_heads, num_kv_heads,
                                      head_dim, block_size, dtype)
    scale = head_dim**-0.5
    plan = TritonAttentionPlan(num_splits=num_splits)
    fn = lambda: paged_decode_attention_triton(query, cache, meta, scale, plan)  # noqa: E731
    err = _max_err(fn(), query, cache, meta, scale) if check else float("nan")
    ms = cuda_time_ms(fn, iters, warmup)
    kv_bytes = 2 * batch_size * context_len * num_kv_heads * head_dim * cache.element_size()
    splits = num_splits or decode_num_splits(batch_size, num_kv_heads, context_len,
                                             torch.cuda.get_device_properties(0).multi_processor_count)
    return {"kernel": "decode", "batch_size": batch_size, "context_len": context_len, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": block_size, "dtype": str(dtype),
            "num_splits": splits, "time_ms": ms, "kv_bytes": kv_bytes, "gbps": kv_bytes / ms / 1e6,
            "max_abs_err": err}


def bench_prefill_attention(
    num_seqs: int = 4, prompt_len: int = 2048, prefix_len: int = 0, num_heads: int = 32, num_kv_heads: int = 8,
    head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
    iters: int = 20, warmup: int = 3, check: bool = True, plan: TritonAttentionPlan | None = None,
) -> dict:
    """``num_seqs`` chunks of ``prompt_len`` new tokens after ``prefix_len`` cached ones: time, causal TFLOP/s."""
    seq_len = prefix_len + prompt_len
    query, cache, meta = _random_step([prompt_len] * num_seqs, [seq_len] * num_seqs, num_heads, num_kv_heads,
                                      head_dim, block_size, dtype)
    scale = head_dim**-0.5
    fn = lambda: paged_prefill_attention_triton(query, cache, meta, scale, plan)  # noqa: E731
    err = _max_err(fn(), query, cache, meta, scale) if check else float("nan")
    ms = cuda_time_ms(fn, iters, warmup)
    keys_attended = num_seqs * sum(prefix_len + t + 1 for t in range(prompt_len))
    flops = 4 * num_heads * head_dim * keys_attended
    return {"kernel": "prefill", "num_seqs": num_seqs, "prompt_len": prompt_len, "prefix_len": prefix_len,
            "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "block_size": block_size,
            "dtype": str(dtype), "time_ms": ms, "flops": flops, "tflops": flops / ms / 1e9, "max_abs_err": err}
