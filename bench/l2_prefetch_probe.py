"""Does a weight prefetched into L2 during idle time make the next GEMV faster? JSON out.

    python3 bench/l2_prefetch_probe.py --out $OUT/l2-prefetch-probe.json

48 distinct o_proj-shaped weights ([2048, 4096] bf16, 806 MB: each GEMV reads its weight cold), one CUDA graph per
variant, per layer: ``idle`` (a spin kernel of S us, then the GEMV), ``prefetch_idle`` (a kernel issuing the bulk
L2 prefetch of the weight, the spin, the GEMV), ``touch_idle`` (a kernel loading the whole weight with evict_last
instead), ``prefetch`` (the prefetch kernel then at once the GEMV), ``gemv`` (the GEMV alone), ``prefetch_only``.
Reports us per layer. The prefetch is a bulk ``cp.async.bulk.prefetch.L2`` per thread (Hopper).
(The decode attention issuing it for o_proj before its dependent-launch wait lost end to end; bench/README.md.)"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.bench_attention import cuda_time_ms  # noqa: E402
from kernels.triton_compat import jit, tl  # noqa: E402
from kernels.triton_gemv import gemv_triton  # noqa: E402


@jit
def l2_prefetch(base_ptr, nbytes, part, num_parts, LANES: tl.constexpr):
    """Bulk-prefetch program ``part`` of ``num_parts``'s share of the ``nbytes`` (a multiple of 16) at
    ``base_ptr`` into L2: ``LANES`` spans, one a thread. Fire and forget: nothing waits for the data."""
    lane_bytes = tl.cdiv(tl.cdiv(nbytes, num_parts * LANES), 16) * 16
    lanes = tl.arange(0, LANES)
    start = (part.to(tl.int64) * LANES + lanes) * lane_bytes
    size = tl.minimum(tl.maximum(nbytes - start, 0), lane_bytes).to(tl.int32)
    addr = base_ptr.to(tl.pointer_type(tl.int8)) + start
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1,
    )


LANES = 128


def prefetch_bytes(weight: torch.Tensor) -> int:
    return weight.numel() * weight.element_size() // 16 * 16


@jit
def _prefetch_kernel(w_ptr, nbytes, LANES: tl.constexpr):
    l2_prefetch(w_ptr, nbytes, tl.program_id(0), tl.num_programs(0), LANES)


@jit
def _touch_kernel(w_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--programs", type=int, nargs="+", default=[132, 264])
    ap.add_argument("--idle-us", type=float, nargs="+", default=[3.0, 6.0, 12.0])
    args = ap.parse_args()
    dev = torch.device("cuda")
    weights = [torch.randn(2048, 4096, dtype=torch.bfloat16, device=dev) for _ in range(args.layers)]
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
    sink = torch.zeros(1024, dtype=torch.float32, device=dev)
    torch.cuda._sleep(1000)
    clock_ghz = 2e6 / (cuda_time_ms(lambda: torch.cuda._sleep(2_000_000), iters=5, warmup=1) * 1e6)  # cycles / ns
    results: dict = {"device": torch.cuda.get_device_name(), "clock_ghz": clock_ghz, "layers": args.layers}

    def graph_of(body) -> torch.cuda.CUDAGraph:
        body()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        return g

    def time_us(body) -> float:
        g = graph_of(body)
        return cuda_time_ms(g.replay, iters=30, warmup=5) * 1e3 / args.layers

    def prefetch(w, programs):
        _prefetch_kernel[(programs,)](w, prefetch_bytes(w), LANES=LANES, num_warps=4)

    def touch(w, programs):
        _touch_kernel[(programs,)](w, sink, w.numel(), BLOCK=2048, num_warps=8)

    results["gemv"] = time_us(lambda: [gemv_triton(x, w) for w in weights])
    for p in args.programs:
        results[f"prefetch_only_p{p}"] = time_us(lambda: [prefetch(w, p) for w in weights])
        results[f"prefetch_p{p}"] = time_us(lambda: [(prefetch(w, p), gemv_triton(x, w)) for w in weights])
        results[f"touch_only_p{p}"] = time_us(lambda: [touch(w, p) for w in weights])
    for us in args.idle_us:
        cycles = int(us * clock_ghz * 1e3)
        results[f"idle_only_{us}us"] = time_us(lambda: [torch.cuda._sleep(cycles) for w in weights])
        results[f"idle_{us}us"] = time_us(lambda: [(torch.cuda._sleep(cycles), gemv_triton(x, w)) for w in weights])
        for p in args.programs:
            results[f"prefetch_idle_{us}us_p{p}"] = time_us(
                lambda: [(prefetch(w, p), torch.cuda._sleep(cycles), gemv_triton(x, w)) for w in weights])
        results[f"touch_idle_{us}us"] = time_us(
            lambda: [(touch(w, 132), torch.cuda._sleep(cycles), gemv_triton(x, w)) for w in weights])
    for k, v in results.items():
        print(k, round(v, 3) if isinstance(v, float) else v)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
