"""Sweep the batch-1 GEMV's launch parameters over a model's decode shapes; JSON out.

    python3 bench/gemv_tune.py --out $OUT/gemv_tune.json [--shapes 5120x2048 2048x4096 128x2048 151936x2048]

Each shape is ``NxK`` (weight rows x the contiguous dim). For every point, ``kernels.triton_gemv.bench_gemv``
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.triton_gemv import bench_gemv, gemv_config  # noqa: E402

QWEN3_30B_A3B = ["5120x2048", "2048x4096", "128x2048", "151936x2048"]  # qkv, o, router, lm_head


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
