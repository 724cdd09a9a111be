"""Does a GEMV that copies its whole weight slice before its dependent-launch wait hide the load behind a
latency-bound kernel before it? JSON out.

    python3 bench/gemv_overlap_probe.py --out $OUT/gemv-overlap-probe.json

48 distinct o_proj-shaped weights ([2048, 4096] bf16, past L2), one CUDA graph per variant under PDL, per layer: a
``spin`` kernel (128 programs that let the next kernel launch, wait for the kernel before, then spin S us reading
nothing: a decode attention's DRAM-idle time), then the GEMV: ``tiled`` (``_gemv_kernel``, first tile before the
wait) or ``smem`` (kernels/triton_gemv_smem.py). Also each GEMV chained alone (S = 0), the spin alone, and the row
loop (M = 5: exact verify rows) of both. Reports us per layer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import triton_gemv_smem  # noqa: E402
from kernels.bench_attention import cuda_time_ms  # noqa: E402
from kernels.triton_compat import gdc_launch_dependents, gdc_wait, jit, tl  # noqa: E402
from kernels.triton_gemv import gemv_ref, gemv_triton  # noqa: E402

try:
    from triton.language.extra.cuda import globaltimer
except ImportError:
    globaltimer = None


@jit
def _spin_kernel(out_ptr, ns):
    """PDL: the next kernel may launch at once; after the wait, spin ``ns`` nanoseconds (no DRAM traffic)."""
    gdc_launch_dependents()
    gdc_wait()
    start = globaltimer()
    now = start
    while now - start < ns:
        now = globaltimer()
    if tl.program_id(0) == 0:
        tl.store(out_ptr, (now - start).to(tl.float32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--idle-us", type=float, nargs="+", default=[0.0, 3.0, 6.0])
    args = ap.parse_args()
    dev = torch.device("cuda")
    weights = [torch.randn(2048, 4096, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(args.layers)]
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
    x5 = torch.randn(5, 4096, dtype=torch.bfloat16, device=dev)
    sink = torch.zeros(1, dtype=torch.float32, device=dev)
    results: dict = {"device": torch.cuda.get_device_name(), "layers": args.layers}

    def gemv(variant: str, xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        triton_gemv_smem.SMEM = variant == "smem"
        try:
            return gemv_triton(xs, w, row_loop=xs.shape[0] > 1)
        finally:
            triton_gemv_smem.SMEM = True

    def spin(ns: int) -> None:
        _spin_kernel[(128,)](sink, ns, num_warps=4, launch_pdl=True)

    def time_us(body) -> float:
        body()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        return cuda_time_ms(g.replay, iters=30, warmup=5) * 1e3 / args.layers

    for variant in ("tiled", "smem"):
        y = gemv(variant, x, weights[0])
        results[f"max_err_{variant}"] = (y.float() - gemv_ref(x, weights[0]).float()).abs().max().item()
        y5 = gemv(variant, x5, weights[0])
        results[f"row_loop_bitwise_{variant}"] = all(
            torch.equal(y5[i:i + 1], gemv(variant, x5[i:i + 1], weights[0])) for i in range(5))
    for us in args.idle_us:
        ns = int(us * 1e3)
        if us:
            results[f"spin_only_{us}us"] = time_us(lambda: [spin(ns) for _ in weights])
        for variant in ("tiled", "smem"):
            if us:
                results[f"{variant}_after_{us}us"] = time_us(
                    lambda: [(spin(ns), gemv(variant, x, w)) for w in weights])
            else:
                results[f"{variant}_alone"] = time_us(lambda: [gemv(variant, x, w) for w in weights])
                results[f"{variant}_rows5_alone"] = time_us(lambda: [gemv(variant, x5, w) for w in weights])
    for k, v in results.items():
        print(k, round(v, 3) if isinstance(v, float) else v)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
