"""Sweep the fused MoE kernels' launch parameters on one GPU for a MoE shape; JSON out.

    python3 bench/moe_tune.py --out $OUT/moe_tune.json [--hidden 2048 --inter 768 --experts 128 --top-k 8]

Decode kernels (``kernels/triton_moe_decode.py``) at 1-64 tokens: the gate/up config with the default down config,
then the down config with the best gate/up. Grouped GEMMs (``kernels/triton_moe.py``) at 16-8192 tokens: per
BLOCK_M, the gate/up config then the down config the same way. Each point is the mean of a CUDA graph of
``ROUTES`` calls with different random routings, so consecutive calls read different experts (cold weights, as
in a model, where each layer's experts are other tensors). Timings only: the chosen figures go into the kernels'
tables by hand, with the sweep's JSON kept in bench/results/.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.moe import route_topk_ref  # noqa: E402
from kernels.triton_moe import GroupedConfig, fused_moe_triton, grouped_config  # noqa: E402
from kernels.triton_moe_decode import decode_config, fused_moe_decode_triton  # noqa: E402

ROUTES = 8


def graph_ms(calls: list, reps: int = 5) -> float:
    """Mean device ms of one call, from a CUDA graph of all ``calls`` replayed ``reps`` times."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / (reps * len(calls))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--grouped-tokens", type=int, nargs="*", default=[16, 64, 256, 1024, 8192])
    ap.add_argument("--grouped-block-m", type=int, nargs="*", default=[16, 32, 64, 128])
    ap.add_argument("--out", default="moe_tune.json")
    a = ap.parse_args()
    h, i, e, k = a.hidden, a.inter, a.experts, a.top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen) * i ** -0.5
    expert_bytes = 3 * h * i * 2
    report: dict = {"shape": {"hidden": h, "inter": i, "experts": e, "top_k": k},
                    "device": torch.cuda.get_device_name(), "decode": {}, "grouped": {}}
    started = time.perf_counter()

    def inputs(t: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], float]:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        routes = [route_topk_ref(torch.randn(t, e, device="cuda", generator=gen), k, True) for _ in range(ROUTES)]
        touched = sum(int(ids.unique().numel()) for _, ids in routes) / ROUTES
        return x, routes, touched * expert_bytes

    def timed(fn, x, routes, **kw) -> float | None:
        try:
            return graph_ms([lambda w=w, ids=ids: fn(x, w13, w2, w, ids, **kw) for w, ids in routes])
        except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
            print(f"  skip {kw}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            return None

    def best(points: list[dict]) -> dict:
        return min((p for p in points if p["ms"] is not None), key=lambda p: p["ms"])

    for t in a.decode_tokens:
        x, routes, moved = inputs(t)
        gate_up = [{"gate_up": c, "ms": timed(fused_moe_decode_triton, x, routes, gate_up_config=c)}
                   for c in itertools.product((4, 8, 16, 32), (128, 256, 512), (2, 4, 8))]
        g = best(gate_up)["gate_up"]
        down = [{"down": c, "ms": timed(fused_moe_decode_triton, x, routes, gate_up_config=g, down_config=c)}
                for c in itertools.product((2, 4, 8, 16), (64, 128, 256), (2, 4, 8))]
        top = best(down)
        default = timed(fused_moe_decode_triton, x, routes)
        report["decode"][str(t)] = {"bytes": moved, "default": {"config": decode_config(t, k), "ms": default},
                                    "best": {"gate_up": g, "down": top["down"], "ms": top["ms"]},
                                    "gate_up_sweep": gate_up, "down_sweep": down}
        print(f"decode T={t}: default {default:.4f} ms, best {top['ms']:.4f} ms gate_up {g} down {top['down']} "
              f"({moved / 1e6:.1f} MB) [{time.perf_counter() - started:.0f}s]", flush=True)
        write(a.out, report)

    for t in a.grouped_tokens:
        x, routes, moved = inputs(t)
        rows = []
        for bm in a.grouped_block_m:
            base = GroupedConfig(bm, (64, 64, 4, 3), (64, 64, 4, 3))
            tiles = list(itertools.product((64, 128), (64, 128), (4, 8), (3, 4)))
            gate_up = [{"gate_up": c, "ms": timed(fused_moe_triton, x, routes,
                                                   config=GroupedConfig(bm, c, base.down))} for c in tiles]
            g = best(gate_up)["gate_up"]
            down = [{"down": c, "ms": timed(fused_moe_triton, x, routes, config=GroupedConfig(bm, g, c))}
                    for c in tiles]
            top = best(down)
            rows.append({"block_m": bm, "gate_up": g, "down": top["down"], "ms": top["ms"],
                         "gate_up_sweep": gate_up, "down_sweep": down})
        default_cfg = grouped_config(t, k, e)
        default = timed(fused_moe_triton, x, routes, config=default_cfg)
        winner = min(rows, key=lambda r: r["ms"])
        report["grouped"][str(t)] = {"bytes": moved, "flops": 2 * 3 * h * i * t * k,
                                     "default": {"config": repr(default_cfg), "ms": default},
                                     "best": {k2: winner[k2] for k2 in ("block_m", "gate_up", "down", "ms")},
                                     "per_block_m": rows}
        print(f"grouped T={t}: default {default:.4f} ms, best {winner['ms']:.4f} ms bm {winner['block_m']} "
              f"gate_up {winner['gate_up']} down {winner['down']} [{time.perf_counter() - started:.0f}s]", flush=True)
        write(a.out, report)
        if t <= 64:  # where the decode kernels still compete
            report["grouped"][str(t)]["decode_default_ms"] = timed(fused_moe_decode_triton, x, routes)
    write(a.out, report)


def write(path: str, report: dict) -> None:
    with open(path, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
