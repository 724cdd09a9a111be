"""FP8 weights against bf16 on one GPU: decode GEMVs, the MoE decode step and prefill GEMMs; JSON out.

    python3 bench/fp8_kernels.py            # writes $OUT/fp8_kernels.json (OUT defaults to /tmp), prints a table

- ``gemv``: the Qwen3-8B decode projections (qkv 6144x4096, o 4096x4096, gate_up 24576x4096, down 4096x12288) at
  M = 1 and 8: the bf16 GEMV (``gemv_triton``, the TMA kernel where it routes there) against the FP8 GEMV
  (``fp8_gemv_triton``, 128 x 128 block scales).
- ``moe``: one token through the Qwen3.5-35B-A3B experts (256 routed + the folded shared expert, H 2048, I 512,
  top-8 + the shared slot): ``fused_moe_decode_triton`` on bf16 stacks against FP8 stacks.
- ``prefill``: qkv and gate_up at M = 512 and 2048: dequantize + F.linear (the FP8 prefill path) against bf16
  F.linear.
- ``variants``: FP8 launch parameters beside the heuristic's (``GEMV_VARIANTS`` at M = 1 and 8; the MoE's FP8
  gate/up and down tiles, ``MOE_GATE_UP`` / ``MOE_DOWN``), for tuning ``fp8_gemv_config`` and the MoE's FP8 tiles.

Each figure is the median over replays of a CUDA graph of back-to-back calls (CUDA events), the weights rotating over
enough copies (or, for the MoE, routings) to overflow L2, so GB/s (bytes each call reads: weights, scales, x, y) is an
HBM figure, as decode sees it. Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GEMV_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
PREFILL_SHAPES = {"qkv": (6144, 4096), "gate_up": (24576, 4096)}
QWEN35_MOE = dict(experts=257, hidden=2048, inter=512, top_k=8)  # + the folded shared expert's slot
GEMV_VARIANTS = {  # launch overrides beside the heuristic's, by M, on the shapes named
    1: (("o", "down", "gate_up"), [
        {"block_n": 2, "block_k": 2048}, {"block_n": 8, "block_k": 512}, {"block_n": 4, "block_k": 1024, "k_sub": 2},
        {"block_n": 8, "block_k": 1024, "num_warps": 8}, {"block_n": 4, "block_k": 2048, "num_warps": 8},
        {"block_n": 2, "block_k": 1024, "k_sub": 2}, {"block_n": 16, "block_k": 256},
        {"block_n": 4, "block_k": 512, "k_sub": 2}]),
    8: (("o", "gate_up"), [
        {"split_k": 2}, {"split_k": 4}, {"split_k": 8}, {"block_n": 32, "split_k": 2}, {"block_n": 32, "split_k": 4},
        {"block_n": 16, "split_k": 4}]),
}
MOE_GATE_UP = [(8, 512, 8), (16, 256, 8), (8, 256, 4), (4, 1024, 8), (16, 512, 8), (8, 512, 4), (8, 256, 8, 3),
               (16, 256, 8, 3)]  # FP8 gate/up tiles (BLOCK_N, BLOCK_K, warps[, stages]) beside the default's
MOE_DOWN = [(2, 128, 4), (4, 64, 4), (4, 128, 4), (8, 64, 4), (2, 128, 8), (1, 128, 4), (8, 128, 8)]
CALLS = 20  # calls a graph
REPLAYS = 15  # graph replays timed; the median is kept


def graph_ms(fn, variants: int) -> float:
    """Median ms a call of ``fn(i)`` (i cycling over ``variants``) over CUDA-graph replays of CALLS calls."""
    for i in range(variants):  # compile and warm
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(i % variants)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    del graph
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    """Weight copies that overflow L2 three times over (at most CALLS)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(CALLS, -(-3 * l2 // nbytes)))


def figure(ms: float, nbytes: int) -> dict:
    return {"us": round(ms * 1000, 2), "bytes": nbytes, "gb_s": round(nbytes / (ms * 1e-3) / 1e9, 1)}


def bench_gemv(name: str, n: int, k: int, m: int) -> dict:
    from kernels.fp8 import quantize_fp8_block_ref
    from kernels.triton_fp8_gemv import fp8_gemv_ref, fp8_gemv_triton
    from kernels.triton_gemv import gemv_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    base = torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5
    q, scale = quantize_fp8_block_ref(base)
    dense = base.bfloat16()
    del base
    act = (m * k + m * n) * 2
    bf16_bytes, fp8_bytes = n * k * 2 + act, n * k + scale.numel() * 4 + act
    dense_w = [dense] + [dense.clone() for _ in range(copies_for(n * k * 2) - 1)]
    bf16_ms = graph_ms(lambda i, w=dense_w: gemv_triton(x, w[i]), len(dense_w))
    del dense_w
    fp8_w = [q] + [q.clone() for _ in range(copies_for(n * k) - 1)]
    fp8_ms = graph_ms(lambda i, w=fp8_w: fp8_gemv_triton(x, w[i], scale, (128, 128)), len(fp8_w))
    del fp8_w
    error = (fp8_gemv_triton(x, q, scale, (128, 128)).float() - fp8_gemv_ref(x, q, scale, (128, 128)).float())
    return {"shape": name, "n": n, "k": k, "m": m, "bf16": figure(bf16_ms, bf16_bytes),
            "fp8": figure(fp8_ms, fp8_bytes), "speedup": round(bf16_ms / fp8_ms, 3),
            "fp8_max_abs_error": error.abs().max().item()}


def bench_gemv_variants() -> list[dict]:
    from kernels.fp8 import quantize_fp8_block_ref
    from kernels.triton_fp8_gemv import fp8_gemv_config, fp8_gemv_triton

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for m, (shapes, variants) in GEMV_VARIANTS.items():
        for name in shapes:
            n, k = GEMV_SHAPES[name]
            gen = torch.Generator(device="cuda").manual_seed(3)
            q, scale = quantize_fp8_block_ref(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5)
            weights = [q] + [q.clone() for _ in range(copies_for(n * k) - 1)]
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            nbytes = n * k + scale.numel() * 4 + (m * k + m * n) * 2
            for overrides in [{}] + variants:
                ms = graph_ms(lambda i, w=weights: fp8_gemv_triton(x, w[i], scale, (128, 128), **overrides),
                              len(weights))
                config = {**fp8_gemv_config(m, n, k, (128, 128), torch.bfloat16, sms), **overrides}
                rows.append({"shape": name, "m": m, "config": config, "default": not overrides,
                             **figure(ms, nbytes)})
            del weights
            torch.cuda.empty_cache()
    return rows


def bench_moe() -> dict:
    from kernels.fp8 import Fp8Weight, quantize_fp8_block_ref
    from kernels.moe import fused_moe_ref, route_topk_ref
    from kernels.triton_moe_decode import fused_moe_decode_triton

    e, h, inter, top_k = (QWEN35_MOE[key] for key in ("experts", "hidden", "inter", "top_k"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    w13 = torch.randn(e, 2 * inter, h, device="cuda", generator=gen) / h ** 0.5
    q13, s13 = quantize_fp8_block_ref(w13)
    w13 = w13.bfloat16()
    w2 = torch.randn(e, h, inter, device="cuda", generator=gen) / inter ** 0.5
    q2, s2 = quantize_fp8_block_ref(w2)
    w2 = w2.bfloat16()
    fp8 = (Fp8Weight(q13, s13, (128, 128)), Fp8Weight(q2, s2, (128, 128)))
    x = torch.randn(1, h, device="cuda", generator=gen).bfloat16()
    routes = []
    for _ in range(CALLS):  # another draw of experts a call: their weights arrive cold, as each layer's do
        weights, ids = route_topk_ref(torch.randn(1, e - 1, device="cuda", generator=gen), top_k, True)
        routes.append((torch.cat([weights, torch.full_like(weights[:, :1], 0.5)], 1),
                       torch.cat([ids, torch.full_like(ids[:, :1], e - 1)], 1)))
    slots = top_k + 1
    per_expert = 3 * inter * h
    bf16_bytes = slots * per_expert * 2 + 2 * h * 2
    fp8_bytes = slots * (per_expert + (s13[0].numel() + s2[0].numel()) * 4) + 2 * h * 2
    bf16_ms = graph_ms(lambda i: fused_moe_decode_triton(x, w13, w2, *routes[i]), len(routes))
    fp8_ms = graph_ms(lambda i: fused_moe_decode_triton(x, *fp8, *routes[i]), len(routes))
    variants = [{"gate_up": cfg, **figure(graph_ms(lambda i: fused_moe_decode_triton(
        x, *fp8, *routes[i], gate_up_config=cfg), len(routes)), fp8_bytes)} for cfg in MOE_GATE_UP]
    variants += [{"down": cfg, **figure(graph_ms(lambda i: fused_moe_decode_triton(
        x, *fp8, *routes[i], down_config=cfg), len(routes)), fp8_bytes)} for cfg in MOE_DOWN]
    error = (fused_moe_decode_triton(x, *fp8, *routes[0]).float() - fused_moe_ref(x, *fp8, *routes[0]).float())
    return {"experts": e, "hidden": h, "inter": inter, "slots": slots, "bf16": figure(bf16_ms, bf16_bytes),
            "fp8": figure(fp8_ms, fp8_bytes), "speedup": round(bf16_ms / fp8_ms, 3),
            "fp8_max_abs_error": error.abs().max().item(), "fp8_variants": variants}


def bench_prefill(name: str, n: int, k: int, m: int) -> dict:
    from kernels.fp8 import quantize_fp8_block_ref
    from kernels.triton_fp8_gemm import dequant_linear

    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    base = torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5
    q, scale = quantize_fp8_block_ref(base)
    dense = base.bfloat16()
    del base
    flops = 2 * m * n * k
    out = {"shape": name, "n": n, "k": k, "m": m}
    for label, fn in (("dequant_f_linear", lambda i: dequant_linear(x, q, scale, (128, 128))),
                      ("bf16_f_linear", lambda i: F.linear(x, dense))):
        ms = graph_ms(fn, 1)
        out[label] = {"us": round(ms * 1000, 1), "tflop_s": round(flops / (ms * 1e-3) / 1e12, 1)}
    out["fp8_over_bf16_time"] = round(out["dequant_f_linear"]["us"] / out["bf16_f_linear"]["us"], 3)
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("fp8_kernels: no CUDA device here; this benchmark times GPU kernels only")
        return 0
    began = time.time()
    results = {"device": torch.cuda.get_device_name(0), "gemv": [], "prefill": []}
    for name, (n, k) in GEMV_SHAPES.items():
        for m in (1, 8):
            results["gemv"].append(bench_gemv(name, n, k, m))
            torch.cuda.empty_cache()
    results["variants"] = bench_gemv_variants()
    torch.cuda.empty_cache()
    results["moe"] = bench_moe()
    torch.cuda.empty_cache()
    for name, (n, k) in PREFILL_SHAPES.items():
        for m in (512, 2048):
            results["prefill"].append(bench_prefill(name, n, k, m))
    results["seconds"] = round(time.time() - began, 1)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "fp8_kernels.json")
    with open(path, "w") as handle:
        json.dump(results, handle, indent=1)
    print(f"{results['device']}: decode (us per call, GB/s)")
    print(f"{'shape':>10} {'M':>3} {'bf16 us':>9} {'GB/s':>7} {'fp8 us':>9} {'GB/s':>7} {'speedup':>8}")
    for row in results["gemv"] + [dict(results["moe"], shape="moe", m=1)]:
        print(f"{row['shape']:>10} {row['m']:>3} {row['bf16']['us']:>9} {row['bf16']['gb_s']:>7} "
              f"{row['fp8']['us']:>9} {row['fp8']['gb_s']:>7} {row['speedup']:>8}")
    print("FP8 GEMV launch variants (us, GB/s)")
    for row in results["variants"]:
        cfg = row["config"]
        print(f"  {row['shape']:>8} M={row['m']:<2} block_n={cfg['block_n']:<3} block_k={cfg['block_k']:<4} "
              f"k_sub={cfg['k_sub']:<2} split_k={cfg['split_k']:<2} warps={cfg['num_warps']} {row['us']:>8} "
              f"{row['gb_s']:>7}{'  (default)' if row['default'] else ''}")
    for row in results["moe"]["fp8_variants"]:
        print(f"  MoE {'gate/up' if 'gate_up' in row else 'down'} {row.get('gate_up') or row.get('down')}: "
              f"{row['us']} us, {row['gb_s']} GB/s")
    print("prefill (us per call, TFLOP/s)")
    print(f"{'shape':>10} {'M':>5} {'dequant+lin':>14} {'bf16 lin':>14}  fp8/bf16 time")
    for row in results["prefill"]:
        cells = [f"{row[key]['us']:>7} {row[key]['tflop_s']:>6}" for key in
                 ("dequant_f_linear", "bf16_f_linear")]
        print(f"{row['shape']:>10} {row['m']:>5} {' '.join(cells)}  {row['fp8_over_bf16_time']}")
    print(f"wrote {path} ({results['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
