"""A dense model's decode projections at 1..16 rows: the one-row kernels (each row in turn above one row: exact
verify rows today) against the shared-tile TMA kernel (kernels/triton_gemv_tma_rows.py). JSON out.

    python3 bench/gemv_rows.py --out $OUT/gemv-rows.json [--shape qwen3-8b] [--rows 1 2 5 8 16]

Every layer's projections as in a decode step (qkv and gate/up with the residual-add norm inside, o and down
plain), one weight set per layer (past L2), then the lm_head, replayed from one CUDA graph under the device's
dependent-launch default. Variants: ``loop`` (``gemv_triton`` / ``gemv_norm_triton`` with ``row_loop``: TMA for the
large weights, the tiled kernel below), ``rows`` (the shared-tile kernel with the TMA kernel's tiles) and
``rows:BNxBKsSpP`` (that tile, S stages, P programs an SM, for every projection). Also, per variant, whether a row's output in an M-row call equals its one-row call's
bits on one projection of each kind.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.triton_gemv as tg  # noqa: E402
import kernels.triton_gemv_tma_rows as trows  # noqa: E402
from kernels.bench_attention import cuda_time_ms  # noqa: E402

# per layer: (name, N, K, kind); "norm": the residual-add norm inside; "plain"; then the lm_head
SHAPES = {
    "qwen3-8b": (36, 4096, [("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "plain"),
                            ("gate_up", 24576, 4096, "norm"), ("down", 4096, 12288, "plain")], 151936),
}
TILES = ("8x1024s3p4", "4x1024s4p4", "8x512s4p4", "16x512s3p4", "8x1024s3p8")


def rows_kw(variant: str) -> dict:
    if variant == "rows":
        return {}
    tile, rest = variant[len("rows:"):].split("s")
    stages, pps = rest.split("p")
    bn, bk = (int(v) for v in tile.split("x"))
    return {"block_n": bn, "block_k": bk, "stages": int(stages), "programs_per_sm": int(pps)}


def project(variant: str, x, w, kind: str, r=None, nw=None):
    """One projection under ``variant``: (output, new residual or None)."""
    if variant == "loop":
        if kind == "norm":
            out = tg.gemv_norm_triton(x, r, nw, 1e-6, w, row_loop=True)
            return out.y, out.residual
        return tg.gemv_triton(x, w, row_loop=True), None
    kw = rows_kw(variant)
    if kind == "norm":
        out = trows.gemv_norm_tma_rows(x, r, nw, 1e-6, w, **kw)
        return out.y, out.residual
    return trows.gemv_tma_rows(x, w, **kw), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16])
    ap.add_argument("--variants", nargs="*", default=["loop", "rows"] + [f"rows:{t}" for t in TILES])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "gemv_rows.json"))
    a = ap.parse_args()
    layers, hidden, projections, vocab = SHAPES[a.shape]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)

    stack = [[(name, weight(n, k), kind) for name, n, k, kind in projections] for _ in range(layers)]
    head = weight(vocab, hidden)
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(torch.bfloat16)
    weight_bytes = sum(w.numel() * 2 for layer in stack for _, w, _ in layer) + head.numel() * 2
    report: dict = {"device": torch.cuda.get_device_name(0), "shape": a.shape, "weight_bytes": weight_bytes,
                    "rows": {}, "row_bits_equal": {}}

    def chain(variant: str, x0: torch.Tensor, r0: torch.Tensor) -> torch.Tensor:
        hidden_x, residual = x0, r0
        for layer in stack:
            for name, w, kind in layer:
                if kind == "norm":
                    y, residual = project(variant, hidden_x, w, kind, residual, nw)
                    mixer = y
                else:  # o reads the attention's width (q heads x head_dim = hidden), down the MLP's
                    hidden_x, _ = project(variant, mixer[:, :w.shape[1]].contiguous(), w, kind)
        return project(variant, hidden_x, head, "plain")[0]

    for m in a.rows:
        x0 = torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        r0 = torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        for variant in a.variants:
            try:
                chain(variant, x0, r0)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    chain(variant, x0, r0)
                ms = cuda_time_ms(graph.replay, iters=10, warmup=2)
                row = {"ms": ms, "GBps": weight_bytes / ms / 1e6}
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                row = {"error": f"{type(e).__name__}: {e}"[:1000]}
            report["rows"].setdefault(variant, {})[m] = row
            print(a.shape, variant, m, row, flush=True)
    for variant in a.variants:  # each kind's first projection: rows of a 5-row call against one-row calls
        equal = {}
        for name, w, kind in stack[0]:
            x = torch.randn(5, w.shape[1], device="cuda", generator=gen).to(torch.bfloat16)
            r = torch.randn(5, w.shape[1], device="cuda", generator=gen).to(torch.bfloat16)
            n_w = (1 + 0.1 * torch.randn(w.shape[1], device="cuda", generator=gen)).to(torch.bfloat16)
            try:
                many = project(variant, x, w, kind, r, n_w)[0]
                equal[name] = all(torch.equal(many[i:i + 1], project(variant, x[i:i + 1], w, kind, r[i:i + 1], n_w)[0])
                                  for i in range(5))
            except Exception as e:  # noqa: BLE001
                equal[name] = f"{type(e).__name__}: {e}"[:300]
        report["row_bits_equal"][variant] = equal
        print(variant, "row bits equal", equal, flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
