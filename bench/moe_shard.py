"""The fused MoE of one layer over all experts (one GPU) against each expert-parallel rank's share (expert_offset,
num_local_experts), at decode batch sizes: does a rank's half take half the time? Qwen3.5-35B-A3B's layer shape by
default (256 experts of 512, hidden 2048, 8 a token and a folded shared expert, held by the last rank). JSON out.

    python3 bench/moe_shard.py --tokens 1 16 64 256 --out $OUT/moe-shard.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.moe import fused_moe  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_tune import graph_ms  # noqa: E402

REPEATS = 30  # calls in a graph: launch costs out, and each call reads its weights cold


def timed_ms(fn) -> float:
    return graph_ms([fn] * REPEATS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe-shard.json"))
    a = ap.parse_args()
    torch.manual_seed(0)
    e, h, i = a.experts, a.hidden, a.inter
    # enough copies of the weights that every replay reads them from HBM (a step's 40 layers are all cold)
    copies = 4
    full = [(torch.randn(e + 1, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02,
             torch.randn(e + 1, h, i, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
    share = e // a.ranks
    rows = []
    for t in a.tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device="cuda")[:a.top_k] for _ in range(t)]).to(torch.int32)
        ids = torch.cat([ids, torch.full((t, 1), e, device="cuda", dtype=torch.int32)], 1)  # the folded shared expert
        weights = torch.softmax(torch.randn(t, a.top_k + 1, device="cuda"), -1).float()
        state = {"n": 0}

        def one_gpu() -> None:
            w13, w2 = full[state["n"] % copies]
            state["n"] += 1
            fused_moe(x, w13, w2, weights, ids, 0, e + 1)

        row = {"tokens": t, "one_gpu_ms": timed_ms(one_gpu)}
        for rank in range(a.ranks):
            last = rank == a.ranks - 1
            first, count = rank * share, share + last  # the last rank also holds the shared expert (id e)

            def rank_share(first: int = first, count: int = count) -> None:
                w13, w2 = full[state["n"] % copies]
                state["n"] += 1
                fused_moe(x, w13[first:first + count], w2[first:first + count], weights, ids, first, count)

            row[f"rank{rank}_ms"] = timed_ms(rank_share)
        row["slowest_rank_over_one_gpu"] = max(row[f"rank{r}_ms"] for r in range(a.ranks)) / row["one_gpu_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"device": torch.cuda.get_device_name(0), "args": vars(a), "rows": rows}
    with open(a.out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
