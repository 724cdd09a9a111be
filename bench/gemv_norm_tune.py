"""The norm-fused decode GEMV against a norm kernel + the GEMV, over a model's decode shapes; JSON out.

    python3 bench/gemv_norm_tune.py --out $OUT/gemv_norm.json [--shape qwen3.5-35b-a3b] [--m 1 4 16]

For each projection that follows a residual-add RMSNorm in decode (the mixer's input projection, the MoE router,
which also hands the normed rows to the experts), the same work two ways, each as a CUDA graph of ``CALLS`` calls over
weights rotating past L2 (each layer's weight arrives cold, as in decode): ``unfused`` = ``rms_norm_triton`` then
``gemv_triton``, ``fused`` = ``gemv_norm_triton`` at its default and at a few block sizes. Correctness on the device
in the same run: the fused outputs against ``gemv_norm_ref``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.triton_gemv import gemv_norm_ref, gemv_norm_triton, gemv_triton  # noqa: E402
from kernels.triton_norm import rms_norm_triton  # noqa: E402

CALLS = 40
# name: (N, K, norm weight dtype, whether the normed rows are written too)
SHAPES = {
    "qwen3-30b-a3b": {"qkv": (5120, 2048, torch.bfloat16, False), "router": (128, 2048, torch.bfloat16, True)},
    "qwen3.5-35b-a3b": {"gdn_in_proj": (12352, 2048, torch.float32, False),
                        "attn_qkv": (9216, 2048, torch.float32, False),
                        "router": (264, 2048, torch.float32, True)},
}


def graph_us(fns: list) -> float:
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (3 * len(fns))


def one_shape(m: int, n: int, k: int, nw_dtype: torch.dtype, write_normed: bool) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    copies = max(2, 3 * torch.cuda.get_device_properties(dev).L2_cache_size // (n * k * 2) + 1)
    weights = [(torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(dt) for _ in range(min(copies, CALLS))]
    x = torch.randn(m, k, device=dev, generator=gen).to(dt)
    r = torch.randn(m, k, device=dev, generator=gen).to(dt)
    nw = (1 + 0.1 * torch.randn(k, device=dev, generator=gen)).to(nw_dtype)
    eps = 1e-6

    def unfused(w):
        normed, _ = rms_norm_triton(x, nw, eps, r)
        gemv_triton(normed, w)

    def fused(w, **cfg):
        gemv_norm_triton(x, r, nw, eps, w, None, write_normed, **cfg)

    row: dict = {"unfused_us": graph_us([lambda w=w: unfused(w) for w in _cycle(weights)])}
    row["fused_default_us"] = graph_us([lambda w=w: fused(w) for w in _cycle(weights)])
    sweep = []
    blocks = ((2, 4, 8, 16), (256, 512, 1024)) if m == 1 else ((16, 32, 64), (64, 128, 256))  # FMA / dot path
    for bn in blocks[0]:
        for bk in blocks[1]:
            for warps in ((1, 4) if n < 1024 else (4, 8)):
                try:
                    us = graph_us([lambda w=w: fused(w, block_n=bn, block_k=bk, num_warps=warps)
                                   for w in _cycle(weights)])
                except Exception as exc:  # a config the compiler rejects
                    print(f"  skip {(bn, bk, warps)}: {type(exc).__name__}", flush=True)
                    continue
                sweep.append({"block_n": bn, "block_k": bk, "num_warps": warps, "us": us})
    row["best"] = min(sweep, key=lambda p: p["us"]) if sweep else None
    row["sweep"] = sweep
    out = gemv_norm_triton(x, r, nw, eps, weights[0], None, write_normed)
    ref = gemv_norm_ref(x, r, nw, eps, weights[0], None, write_normed)
    row["max_abs_err_y"] = (out.y.float() - ref.y.float()).abs().max().item()
    row["ref_abs_max_y"] = ref.y.float().abs().max().item()
    row["residual_equal"] = bool(torch.equal(out.residual, ref.residual))
    if write_normed:
        row["max_abs_err_normed"] = (out.normed.float() - ref.normed.float()).abs().max().item()
    return row


def _cycle(weights: list) -> list:
    return [weights[i % len(weights)] for i in range(CALLS)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="*", default=list(SHAPES))
    ap.add_argument("--m", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--out", default="gemv_norm.json")
    a = ap.parse_args()
    report: dict = {"device": torch.cuda.get_device_name(), "calls": CALLS, "shapes": {}}
    for shape in a.shape:
        for name, (n, k, nw_dtype, write_normed) in SHAPES[shape].items():
            for m in a.m:
                row = one_shape(m, n, k, nw_dtype, write_normed)
                report["shapes"][f"{shape}/{name}/m{m}"] = row
                print(f"{shape} {name} m={m}: unfused {row['unfused_us']:.1f} us, fused {row['fused_default_us']:.1f}"
                      f" us, best {row['best']}, err {row['max_abs_err_y']:.3g}/{row['ref_abs_max_y']:.3g} "
                      f"residual {row['residual_equal']}", flush=True)
                with open(a.out, "w") as handle:
                    json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
