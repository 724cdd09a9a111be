"""Sweep the batch-1 GEMV's launch parameters over a model's decode shapes; JSON out.

    python3 bench/gemv_tune.py --out $OUT/gemv_tune.json [--shapes 5120x2048 2048x4096 128x2048 151936x2048]

Each shape is ``NxK`` (weight rows x the contiguous dim). For every point, ``bench_gemv``
(CUDA graph, weights rotating past L2): block_n x block_k x split_k x num_warps at M = 1, against the shape's
current default and F.linear. Timings only: chosen figures go into ``gemv_config`` by hand.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.triton_compat import triton  # noqa: E402
from kernels.triton_gemv import gemv_config, gemv_ref, gemv_triton  # noqa: E402

QWEN3_30B_A3B = ["5120x2048", "2048x4096", "128x2048", "151936x2048"]  # qkv, o, router, lm_head


def bench_gemv(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, iters: int = 50,
               **overrides: int | bool) -> dict:
    """Time gemv_triton and F.linear (CUDA only) as CUDA-graph replays of ``iters`` calls, by CUDA events.

    The weight rotates over enough copies to overflow L2, so GB/s (weight + x + y bytes) is an HBM figure, as
    in decode, where each layer's weight arrives cold."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    elt = dtype.itemsize
    copies = max(1, min(iters, triton.cdiv(3 * torch.cuda.get_device_properties(dev).L2_cache_size, n * k * elt)))
    x = torch.randn(m, k, device=dev, generator=gen).to(dtype)
    ws = [(torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(dtype) for _ in range(copies)]

    def timed(fn) -> float:
        for w in ws:
            fn(w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(iters):
                fn(ws[i % copies])
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    triton_ms = timed(lambda w: gemv_triton(x, w, **overrides))
    torch_ms = timed(lambda w: F.linear(x, w))
    err = (gemv_triton(x, ws[0], **overrides).float() - gemv_ref(x, ws[0]).float()).abs().max().item()
    nbytes = (n * k + m * k + m * n) * elt
    return {"m": m, "n": n, "k": k, "triton_ms": triton_ms, "torch_ms": torch_ms,
            "triton_GBps": nbytes / triton_ms / 1e6, "torch_GBps": nbytes / torch_ms / 1e6, "max_abs_err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=QWEN3_30B_A3B)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--out", default="gemv_tune.json")
    a = ap.parse_args()
    report: dict = {"device": torch.cuda.get_device_name(), "m": a.m, "shapes": {}}
    for shape in a.shapes:
        n, k = (int(v) for v in shape.split("x"))
        default = bench_gemv(a.m, n, k, iters=20)
        points = []
        for bn, bk, split, warps in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (1, 2, 4), (4, 8)):
            if bk * split > 2 * k or (split > 1 and n // bn >= 1024):
                continue
            try:
                row = bench_gemv(a.m, n, k, iters=20, block_n=bn, block_k=bk, split_k=split, num_warps=warps)
            except Exception as exc:  # a config the compiler rejects
                print(f"  skip {shape} {(bn, bk, split, warps)}: {type(exc).__name__}", flush=True)
                continue
            points.append({"block_n": bn, "block_k": bk, "split_k": split, "num_warps": warps,
                           "ms": row["triton_ms"], "GBps": row["triton_GBps"]})
        top = min(points, key=lambda p: p["ms"])
        report["shapes"][shape] = {"default_config": gemv_config(a.m, n, k, torch.bfloat16,
                                                                 torch.cuda.get_device_properties(0).multi_processor_count),
                                   "default": default, "best": top, "sweep": points}
        print(f"{shape}: default {default['triton_ms'] * 1e3:.1f} us ({default['triton_GBps']:.0f} GB/s), "
              f"torch {default['torch_ms'] * 1e3:.1f} us, best {top['ms'] * 1e3:.1f} us ({top['GBps']:.0f} GB/s) "
              f"{top}", flush=True)
        with open(a.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
