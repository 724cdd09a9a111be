"""bench/gpu.py's `moe` section: the fused MoE alone (routing groups, gate/up with SiLU-and-mul, down
with the routing weight, the combine) on one layer of a MoE shape, against its bandwidth roofline:
the bytes of the distinct experts the tokens choose, at the measured copy bandwidth."""
from __future__ import annotations

import torch

from gpu_util import time_ms
from kernels.moe import fused_moe, route_topk_ref


def moe_kernel(shape: dict, ceilings: dict | None, tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 64, 256),
               iters: int = 50) -> dict:
    h, i, e, k = (shape[name] for name in ("hidden_size", "moe_intermediate_size", "num_experts",
                                           "num_experts_per_tok"))
    generator = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=generator) * h ** -0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=generator) * i ** -0.5
    expert_bytes = 3 * h * i * 2
    results: dict = {"hidden": h, "moe_intermediate": i, "experts": e, "top_k": k, "rows": {}}
    for t in tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=generator)
        logits = torch.randn(t, e, device="cuda", dtype=torch.float32, generator=generator)
        weights, ids = route_topk_ref(logits, k, True)
        eager_ms = time_ms(lambda: fused_moe(x, w13, w2, weights, ids), iters, "cuda")
        graph = torch.cuda.CUDAGraph()  # as the engine runs it in a decode step: no launch overhead
        with torch.cuda.graph(graph):
            fused_moe(x, w13, w2, weights, ids)
        ms = time_ms(graph.replay, iters, "cuda")
        touched = int(ids.unique().numel())
        moved = touched * expert_bytes + 2 * t * h * 2
        row = {"graph_ms": ms, "eager_ms": eager_ms, "experts_read": touched, "bytes": moved}
        if ceilings:
            roofline_ms = moved / (ceilings["copy_GBps"] * 1e9) * 1e3
            row.update(roofline_ms=roofline_ms, frac_of_roofline=roofline_ms / ms)
        results["rows"][str(t)] = row
    return results
