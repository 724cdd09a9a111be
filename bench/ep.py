"""Expert parallelism on one machine's two GPUs: decode throughput at EP=1 and EP=2 per batch size, EP2/EP1 against
the issue's targets, the all-reduce's share of an EP=2 step and batch 1 against a bandwidth limit. JSON out.

    timeout 180 python3 bench/ep_allreduce.py --hidden 2048 --layers 40 --tokens 1 16 64 256 \\
        --out $OUT/ep-allreduce.json     # (its ranks may hang in NCCL teardown after writing: the timeout ends them)
    python3 bench/ep.py --shape qwen3.5-35b-a3b --allreduce-json $OUT/ep-allreduce.json \\
        --commit $(git rev-parse --short HEAD) --out $OUT/ep.json
    timeout 180 python3 bench/ep_allreduce.py --hidden 3072 --layers 48 --tokens 1 64 --out $OUT/ep-allreduce-122b.json
    python3 bench/ep.py --shape qwen3.5-122b-a10b --eps 2 --batches 1 64 --allreduce-json $OUT/ep-allreduce-122b.json \\
        --out $OUT/ep-122b.json          # two H200s (128 GB of weights a GPU); elsewhere add --layers N
    python3 bench/ep.py --device cpu --quick --batches 1 4 --new-tokens 8      # the control flow (gloo ranks)

Random weights (load_format dummy), one engine at a time (EP=2: the engine starts its worker on GPU 1). Per
(EP, B): B greedy ignore_eos requests of --prompt-len random tokens at once, --new-tokens each, after a short warm-up
at the same B; the best of --repeats. Decode tok/s counts only the window where all B requests decode: from the last
first token (every prefill done) to the first request's end, output tokens in it over its length (B = 1: (n - 1) /
(t_last - t_first)). The all-reduce share of a step and the batch-1 limit: ``derived`` and ``decode_bytes``. Run the
all-reduce bench first in the same call, joined with ``;`` (a timed-out bench must not skip this one). Asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pipeline.engine import Engine  # noqa: E402

from gpu import engine_config, write_model_dir  # noqa: E402
from gpu_requests import prompts, run_one  # noqa: E402
from gpu_shapes import add_engine_args, chosen_shape  # noqa: E402
from gpu_util import free_device, layer_kinds, state_bytes_per_seq  # noqa: E402

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TARGETS = {64: 1.5, 1: 0.8}  # EP2 / EP1 decode tok/s the issue asks for, by batch size
SPEC_GBPS = {"H200": 4800.0, "H100": 3350.0}  # HBM bandwidth by the data sheets (SXM), when --bandwidth-gbs is unset


def decode_rate(results: list[dict]) -> dict:
    """Decode tok/s over the window where every request decodes (module docstring), the mean inter-token latency
    per request ((t_last - t_first) / (n - 1)) and the prefill span (last first token after the start)."""
    start = min(r["start"] for r in results)
    t0, t1 = max(r["stamps"][0][0] for r in results), min(r["stamps"][-1][0] for r in results)
    tokens = sum(k for r in results for t, k in r["stamps"] if t0 < t <= t1)
    if t1 <= t0 or not tokens:  # too few tokens for a window: the batch's whole decode
        t0, t1 = min(r["stamps"][0][0] for r in results), max(r["stamps"][-1][0] for r in results)
        tokens = sum(len(r["ids"]) - 1 for r in results)
    itl = [(r["stamps"][-1][0] - r["stamps"][0][0]) / (len(r["ids"]) - 1) for r in results if len(r["ids"]) > 1]
    return {"tok_s": tokens / (t1 - t0), "window_s": t1 - t0, "window_tokens": tokens,
            "itl_ms_mean": 1e3 * sum(itl) / len(itl) if itl else None, "prefill_s": t0 - start,
            "wall_s": max(r["stamps"][-1][0] for r in results) - start}


async def measure(engine: Engine, ep: int, batch: int, a: argparse.Namespace, seed: int) -> dict:
    before = engine.stats()
    results = await asyncio.gather(*[run_one(engine, p, a.new_tokens) for p in prompts(batch, a.prompt_len, seed)])
    after = engine.stats()
    steps = after["device_steps"] - before["device_steps"]
    par0, par1 = before["expert_parallel"], after["expert_parallel"]
    messages, nbytes = (par1.get(k, 0) - par0.get(k, 0) for k in ("messages", "message_bytes"))
    rate = decode_rate(results)
    return {"ep": ep, "batch": batch, **rate, "decode_step_ms": 1e3 * batch / rate["tok_s"], "device_steps": steps,
            "step_ms_wall": 1e3 * rate["wall_s"] / steps if steps else None, "ep_messages": messages,
            "ep_message_bytes": nbytes, "messages_per_step": messages / steps if steps else None,
            "message_bytes_per_step": nbytes / steps if steps else None,
            "output_tokens": sum(len(r["ids"]) for r in results)}


async def run_ep(a: argparse.Namespace, ep: int, model_dir: str, report: dict) -> None:
    """One engine at EP=ep: every batch size, then shut down (the worker with it)."""
    config = engine_config(a, model_dir, ep_size=ep, max_num_seqs=a.max_num_seqs or max(a.batches),
                           ep_split_linear_attention=a.split_linear_attention if ep > 1 else None,
                           max_model_len=max(1024, a.prompt_len + a.new_tokens + 64), prefix_caching=False,
                           gpu_memory_utilization=a.gpu_memory_utilization)
    begin = time.perf_counter()
    engine = await Engine.create(config, progress=lambda m: print(f"[ep={ep}] {m}", flush=True))
    entry = report["engines"][str(ep)] = {"start_s": time.perf_counter() - begin,
                                          "config": dataclasses.asdict(engine.config)}
    try:
        for batch in a.batches:
            await asyncio.gather(*[run_one(engine, p, 4) for p in prompts(batch, a.prompt_len, 7 + batch)])
            runs = [await measure(engine, ep, batch, a, seed=1000 * batch + i) for i in range(a.repeats)]
            best = max(runs, key=lambda r: r["tok_s"])
            report["rows"].append({**best, "runs_tok_s": [r["tok_s"] for r in runs]})
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in best.items()}), flush=True)
        if a.profile_batch:  # the head's GPU only: its kernels a step, the all-reduces' waits for the worker included
            import torch

            from gpu_steps import top_kernels

            steps = engine.stats()["device_steps"]
            activity = torch.profiler.ProfilerActivity
            kind = activity.CUDA if torch.cuda.is_available() else activity.CPU
            with torch.profiler.profile(activities=[kind]) as prof:
                row = await measure(engine, ep, a.profile_batch, a, seed=99)
            steps = engine.stats()["device_steps"] - steps
            kernels = top_kernels(prof, 30)
            for kernel in kernels["kernels"]:
                kernel["ms_a_step"] = kernel["self_device_ms"] / steps
            entry["profile"] = {"batch": a.profile_batch, "steps": steps, "wall_ms_a_step": row["wall_s"] * 1e3 / steps,
                                "device_ms_a_step": kernels["total_device_ms"] / steps, **kernels}
            print(json.dumps({"ep": ep, "profile": {k: v for k, v in entry["profile"].items() if k != "kernels"}}),
                  flush=True)
            for kernel in kernels["kernels"][:25]:
                print(f"  {kernel['ms_a_step']:8.3f} ms/step {kernel['calls']:6d}  {kernel['name']}", flush=True)
        entry["expert_parallel"] = engine.stats()["expert_parallel"]
    finally:
        await engine.shutdown()
        del engine
        free_device()


def allreduce_step_us(ar: dict | None, tokens: int, reducing_layers: int) -> dict | None:
    """A step's all-reduces from bench/ep_allreduce.py's graph replay (the run at ``tokens``, else the nearest),
    scaled from its layer count to ``reducing_layers``."""
    if not ar or not ar.get("runs"):
        return None
    row = min(ar["runs"], key=lambda r: abs(r["tokens"] - tokens))
    return {"tokens_measured": row["tokens"], "step_us": row["graph_step_us"] * reducing_layers / ar["layers"],
            "measured_layers": ar["layers"], "measured_hidden": ar.get("hidden")}


def busier_rank_experts(s: dict, ep: int, draws: int = 20000) -> float:
    """Expected expert parameters the busier rank computes for one token in one MoE layer: top-k of num_experts
    drawn uniformly (random weights route about evenly), each rank a contiguous share of the experts
    (pipeline/dist/group.py), the shared expert on the last rank; the ranks meet at every layer's all-reduce, so a
    layer takes as long as its busier rank. Monte Carlo, fixed seed."""
    n, k, h = s["num_experts"], s["num_experts_per_tok"], s["hidden_size"]
    routed, shared = 3 * h * s["moe_intermediate_size"], 3 * h * s.get("shared_expert_intermediate_size", 0)
    base, extra = divmod(n, ep)
    owner = [r for r in range(ep) for _ in range(base + (r < extra))]
    rng, total = random.Random(0), 0
    for _ in range(draws):
        counts = [0] * ep
        for e in rng.sample(range(n), k):
            counts[owner[e]] += 1
        total += max(c * routed + (shared if r == ep - 1 else 0) for r, c in enumerate(counts))
    return total / draws


def decode_bytes(s: dict, ep: int, context: int, split: bool) -> dict:
    """Bytes one GPU reads in a batch-1 decode step, bf16 weights (2 bytes a parameter). Every rank: the attention
    and Gated DeltaNet projections, norms and routers, one embedding row, the whole lm_head, the KV of ``context``
    tokens at each attention layer and each GDN layer's recurrent state (read and written); ``split`` (the ranks
    split the GDN heads): 1 / ep of the GDN projections and states. Experts: top-k of
    num_experts, each 3 * hidden * moe_intermediate parameters; ``even_split`` gives a GPU k / ep of them plus the
    shared expert (on one rank), ``busier_rank`` the expected load of the busier rank (busier_rank_experts)."""
    h, nh, kvh, d = (s[x] for x in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    kinds = layer_kinds(s)
    layers, attn = len(kinds), kinds.count("full_attention")
    gate = 2 if s.get("linear_num_value_heads") else 1  # hybrid attention: the query's output gate
    params = {"embedding_row": h, "lm_head": s["vocab_size"] * h, "norms": 2 * h * layers + h + 2 * d * attn,
              "attention": attn * (h * nh * d * (1 + gate) + 2 * h * kvh * d + nh * d * h),
              "routers": layers * (s["num_experts"] * h + (h if s.get("shared_expert_intermediate_size") else 0))}
    if s.get("linear_num_value_heads"):
        key = s["linear_num_key_heads"] * s["linear_key_head_dim"]
        value = s["linear_num_value_heads"] * s["linear_value_head_dim"]
        conv, heads = 2 * key + value, s["linear_num_value_heads"]
        params["gated_deltanet"] = (layers - attn) * (h * (conv + value + 2 * heads) +
                                                      conv * s.get("linear_conv_kernel_dim", 4) + value * h)
    routed, shared = 3 * h * s["moe_intermediate_size"], 3 * h * s.get("shared_expert_intermediate_size", 0)
    share = ep if split else 1
    dense = 2 * sum(v / share if k == "gated_deltanet" else v for k, v in params.items())
    cache = attn * context * 2 * kvh * d * 2 + 2 * state_bytes_per_seq(s) / share
    even = 2 * layers * (s["num_experts_per_tok"] / ep * routed + shared)
    busier = 2 * layers * busier_rank_experts(s, ep)
    return {"ep": ep, "context_tokens": context, "split_linear_attention": split, "dense_params": params,
            "dense_bytes": dense, "kv_and_state_bytes": cache, "experts_bytes_even_split": even,
            "experts_bytes_busier_rank": busier, "total_bytes_even_split": dense + cache + even,
            "total_bytes_busier_rank": dense + cache + busier}


def derived(report: dict, a: argparse.Namespace, shape: dict, ar: dict | None) -> None:
    """Ratios EP2/EP1, the all-reduce share of an EP=2 decode step, and batch 1 against its limit."""
    rows = {(r["ep"], r["batch"]): r for r in report["rows"]}
    report["ratios"] = [{"batch": b, "ep2_over_ep1": rows[2, b]["tok_s"] / rows[1, b]["tok_s"],
                         "target": TARGETS.get(b)} for b in a.batches if (1, b) in rows and (2, b) in rows]
    split = {ep: report["engines"].get(str(ep), {}).get("expert_parallel", {}).get("split_linear_attention", False)
             for ep in a.eps}
    # every layer of these shapes has an MoE block; split Gated DeltaNet layers reduce their output too
    reducing = {ep: shape["num_hidden_layers"] + (layer_kinds(shape).count("linear_attention") if split[ep] else 0)
                for ep in a.eps}
    report["comm_share"] = {"method": "estimated from separately measured all-reduce graph time (bench/"
                                      "ep_allreduce.py, scaled to this shape's all-reducing layers: MoE, and Gated "
                                      "DeltaNet when split) / the EP=2 decode step (B / decode tok/s)", "rows": []}
    for b in a.batches:
        step = allreduce_step_us(ar, b, reducing.get(2, 0))
        if step and (2, b) in rows:
            report["comm_share"]["rows"].append({"batch": b, **step, "decode_step_ms": rows[2, b]["decode_step_ms"],
                                                 "share": step["step_us"] / 1e3 / rows[2, b]["decode_step_ms"]})
    gpu = report["machine"]["gpus"][0] if report["machine"]["gpus"] else ""
    bandwidth = a.bandwidth_gbs or next((v for k, v in SPEC_GBPS.items() if k in gpu), 4800.0)
    report["limit"] = {"bandwidth_gbs": bandwidth, "bandwidth_source": "--bandwidth-gbs" if a.bandwidth_gbs else
                       f"data-sheet value for {gpu or 'an H200'} (not measured)", "by_ep": []}
    for ep in a.eps:
        if (ep, 1) not in rows:
            continue
        terms = decode_bytes(shape, ep, a.prompt_len + a.new_tokens // 2, split[ep])
        comm = allreduce_step_us(ar, 1, reducing[ep]) if ep > 1 else {"step_us": 0.0}
        comm_s = comm["step_us"] * 1e-6 if comm else 0.0
        limit = {f"limit_tok_s_{kind}": 1 / (terms[f"total_bytes_{kind}"] / (bandwidth * 1e9) + comm_s)
                 for kind in ("busier_rank", "even_split")}
        measured = rows[ep, 1]["tok_s"]
        report["limit"]["by_ep"].append({**terms, **limit, "allreduce_us": comm and comm["step_us"],
                                         "measured_b1_tok_s": measured,
                                         "measured_over_limit": measured / limit["limit_tok_s_busier_rank"]})


def machine(a: argparse.Namespace) -> dict:
    import torch

    cuda = a.device.startswith("cuda")
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return {"device": a.device, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if cuda else [], "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))
            if cuda else None, "env": {k: os.environ.get(k) for k in SAFE_ENV},
            "commit": a.commit or git.stdout.strip() or None, "date": time.strftime("%Y-%m-%d %H:%M")}


def summary(report: dict) -> None:
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\n== {report['shape_name']} on {report['machine']['gpus'] or 'cpu'} ==\n"
          f" ep    B     tok/s  itl ms  step ms  steps msg/step bytes/step")
    for r in report["rows"]:
        print(f"{r['ep']:3d} {r['batch']:4d} {r['tok_s']:9.1f} {fmt(r['itl_ms_mean'], '.2f'):>7s} "
              f"{r['decode_step_ms']:8.2f} {r['device_steps']:6d} {fmt(r['messages_per_step'], '.2f'):>8s} "
              f"{fmt(r['message_bytes_per_step'], '.0f'):>10s}")
    for r in report["ratios"]:
        print(f"B={r['batch']}: EP2/EP1 {r['ep2_over_ep1']:.2f} (target {fmt(r['target'], '.2f')})")
    for r in report["comm_share"]["rows"]:
        print(f"B={r['batch']}: all-reduce {r['step_us']:.0f} us of a {r['decode_step_ms']:.2f} ms EP=2 step "
              f"({r['share']:.0%}, estimated)")
    for r in report["limit"]["by_ep"]:
        print(f"EP={r['ep']} B=1: {r['measured_b1_tok_s']:.1f} tok/s, limit {r['limit_tok_s_busier_rank']:.1f} "
              f"({r['total_bytes_busier_rank'] / 1e9:.2f} GB a step at {report['limit']['bandwidth_gbs']:.0f} GB/s"
              f" + all-reduce {fmt(r['allreduce_us'], '.0f')} us): {r['measured_over_limit']:.2f} of it")


def main() -> None:
    for key, value in SAFE_ENV.items():  # NVLink multicast off (the device notes), before any CUDA / NCCL init
        os.environ.setdefault(key, value)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))  # the worker
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(ap, "ep.json")
    ap.set_defaults(shape="qwen3.5-35b-a3b")
    ap.add_argument("--eps", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="measured runs per (EP, B); the best is reported")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest batch")
    ap.add_argument("--layers", type=int, default=None, help="trim num_hidden_layers (a shape that does not fit)")
    ap.add_argument("--allreduce-json", default=None, help="bench/ep_allreduce.py's output, for the comm share")
    ap.add_argument("--split-linear-attention", action=argparse.BooleanOptionalAction, default=None,
                    help="EP > 1: each rank keeps its share of every Gated DeltaNet layer's heads and states "
                         "(default: the engine's, which splits them)")
    ap.add_argument("--profile-batch", type=int, default=0,
                    help="also one run at this batch under torch.profiler: the head GPU's kernels a step")
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="HBM GB/s for the limit (default: data sheet)")
    a = ap.parse_args()
    shape = dict(chosen_shape(a.shape, a.quick))
    if not shape.get("num_experts"):
        raise SystemExit(f"{a.shape} has no experts to split")
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    allreduce = json.load(open(a.allreduce_json)) if a.allreduce_json else None
    report: dict = {"bench": "ep", "command": " ".join([sys.executable, *sys.argv]), "machine": machine(a),
                    "shape_name": a.shape, "quick": a.quick, "layers_trimmed_to": a.layers, "shape": shape,
                    "workload": {"eps": a.eps, "batches": a.batches, "prompt_len": a.prompt_len,
                                 "new_tokens": a.new_tokens, "repeats": a.repeats, "weights": "dummy (random)",
                                 "tok_s": "decode only: output tokens while all B requests decode, over that "
                                          "window (from the last first token to the first request's end)"},
                    "allreduce_source": allreduce,
                    "engines": {}, "rows": []}
    model_dir = write_model_dir(shape, a.tokenizer)

    def write() -> None:
        derived(report, a, shape, allreduce)
        with open(a.out, "w") as handle:
            json.dump(report, handle, indent=1, default=str)

    try:
        for ep in a.eps:
            try:
                asyncio.run(run_ep(a, ep, model_dir, report))
            finally:
                write()  # a failure or a kill later keeps what was measured
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    summary(report)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
