"""Split-KV decode attention over a bf16 cache against an fp8 (e4m3) cache at batch 1; JSON out.

    python3 bench/fp8_kv.py            # writes $OUT/fp8_kv.json (OUT: /tmp when unset)

The Qwen3-8B attention shape (32 query heads over 8 KV heads of 128, blocks of 16 tokens as the engine uses) after
4k, 32k and 128k tokens, one sequence, the decode heuristic's split count for the context. Each call (the split
kernel and its reduce) is captured in a CUDA graph and replayed after a write of 256 MiB that evicts the L2, so every
replay reads its keys and values from HBM as a decode step does (the layers between two of its attention calls move
far more than the L2 holds); CUDA events around the replay alone, median of the replays. Bytes: the K and V of the
context (the query, output, partials and block table are under 0.1% of them at 4k). ``max_abs_diff`` is the fp8
output against the bf16 one on the same values (the cache's rounding, not the kernel's).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.fp8 import quantize_kv_ref  # noqa: E402
from kernels.triton_decode_attention import decode_num_splits, paged_decode_attention_triton  # noqa: E402
from kernels.triton_paged_attention import TritonAttentionPlan, num_sms_of  # noqa: E402
from pipeline.models.attention import build_attention_metadata  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Qwen3-8B; the engine's block size
CONTEXTS = (4096, 32768, 131072)
REPLAYS, WARMUP = 200, 10
FLUSH_BYTES = 256 << 20  # over five times the H200's 50 MB L2
K_SCALE, V_SCALE = 0.05, 0.02  # per-layer scales as a checkpoint's k_scale / v_scale might be


def paged_step(context: int, gen: torch.Generator):
    """(query, bf16 cache, fp8 cache of the same values over the scales, metadata): one sequence of ``context``
    keys along a shuffled block table, its last key the step's own."""
    blocks = math.ceil(context / BLOCK_SIZE)
    table = (torch.randperm(blocks, generator=gen, device="cuda") + 1).tolist()  # block 0 unused: padding points there
    shape = (2, blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    bf16 = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    fp8 = torch.stack([quantize_kv_ref(bf16[0], K_SCALE).view(torch.uint8),
                       quantize_kv_ref(bf16[1], V_SCALE).view(torch.uint8)]).view(torch.float8_e4m3fn)
    meta = build_attention_metadata([1], [context], [table], BLOCK_SIZE, "cuda")
    query = torch.randn(1, HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    return query, bf16, fp8, meta


def replay_ms(fn, flush: torch.Tensor) -> list[float]:
    """Milliseconds of each replay of ``fn`` captured in a CUDA graph, the L2 evicted before each."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP):  # compiles, and settles the allocator before capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(REPLAYS):
        flush.add_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def bench() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    sms = num_sms_of(torch.device("cuda"))
    rows = []
    for context in CONTEXTS:
        query, bf16, fp8, meta = paged_step(context, gen)
        plan = TritonAttentionPlan(num_splits=decode_num_splits(1, KV_HEADS, context, sms))
        outputs = {}
        for name, cache, scales in (("bf16", bf16, (1.0, 1.0)), ("fp8", fp8, (K_SCALE, V_SCALE))):
            def call(cache=cache, scales=scales, name=name, query=query, meta=meta):
                outputs[name] = paged_decode_attention_triton(query, cache, meta, HEAD_DIM**-0.5, plan, None,
                                                              *scales)

            ms = statistics.median(replay_ms(call, flush))
            kv_bytes = 2 * context * KV_HEADS * HEAD_DIM * cache.element_size()
            rows.append(dict(context=context, kv_dtype=name, splits=plan.num_splits, time_ms=ms, bytes=kv_bytes,
                             gbps=kv_bytes / ms / 1e6))
        diff = (outputs["fp8"].float() - outputs["bf16"].float()).abs().max().item()
        rows[-1]["max_abs_diff"] = rows[-2]["max_abs_diff"] = diff
        del query, bf16, fp8, meta
        torch.cuda.empty_cache()
    speedup = {str(c): next(r["time_ms"] for r in rows if r["context"] == c and r["kv_dtype"] == "bf16")
               / next(r["time_ms"] for r in rows if r["context"] == c and r["kv_dtype"] == "fp8") for c in CONTEXTS}
    return dict(device=torch.cuda.get_device_name(), heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                block_size=BLOCK_SIZE, batch=1, replays=REPLAYS, k_scale=K_SCALE, v_scale=V_SCALE, rows=rows,
                speedup_fp8_over_bf16=speedup)


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/fp8_kv.py times CUDA kernels: no CUDA device here, nothing run")
        return 0
    result = bench()
    path = os.path.join(os.environ.get("OUT", "/tmp"), "fp8_kv.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['device']}: decode attention, batch 1, {HEADS} heads / {KV_HEADS} KV heads of {HEAD_DIM}")
    print(f"{'context':>8} {'kv':>5} {'splits':>6} {'ms':>8} {'MB read':>8} {'GB/s':>7} {'max diff':>9}")
    for r in result["rows"]:
        print(f"{r['context']:>8} {r['kv_dtype']:>5} {r['splits']:>6} {r['time_ms']:>8.4f} {r['bytes'] / 1e6:>8.1f} "
              f"{r['gbps']:>7.0f} {r['max_abs_diff']:>9.2e}")
    for context, s in result["speedup_fp8_over_bf16"].items():
        print(f"fp8 over bf16 at {context}: {s:.2f}x")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
