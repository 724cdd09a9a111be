"""Check and time everything on the GPU in one call: ceilings, correctness, B1, OFF, SERVE, kernels, peer.

    PYTHONUNBUFFERED=1 python3 bench/gpu.py --commit $(git rev-parse --short HEAD) [--skip serve peer] [--quick]

Model: the Qwen3-8B shape with random bf16 weights (--load-format dummy). Writes $OUT/gpu_bench.json after
every section (a kill keeps what was done) and prints a summary table. Asserts nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pipeline.config import EngineConfig  # noqa: E402
from pipeline.engine import Engine  # noqa: E402

from gpu_correctness import correctness  # noqa: E402
from gpu_requests import itl_stats, off_run, prompts, run_one  # noqa: E402
from gpu_moe import moe_kernel  # noqa: E402
from gpu_steps import step_profile, verify_profile  # noqa: E402
from gpu_util import T0, active_params, free_device, log, num_params, state_bytes_per_seq, time_ms  # noqa: E402
from gpu_shapes import SHAPES, chosen_shape  # noqa: E402

SECTIONS = ("ceilings", "correctness", "graphs", "b1", "off", "steps", "verify", "serve", "kernels", "moe", "peer")


def ceilings(a: argparse.Namespace) -> dict:
    """Device copy bandwidth (bytes read + written) and bf16 matmul rate."""
    x = torch.empty((1 << 24) if a.quick else (1 << 30), dtype=torch.bfloat16, device=a.device).normal_()
    y, nbytes = torch.empty_like(x), 2 * x.numel() * x.element_size()
    copy = nbytes / time_ms(lambda x=x, y=y: y.copy_(x), 10, a.device) / 1e6
    del x, y
    n = 1024 if a.quick else 8192
    m1, m2 = (torch.randn(n, n, dtype=torch.bfloat16, device=a.device) for _ in range(2))
    mm_ms = time_ms(lambda: m1 @ m2, 10, a.device)
    return {"copy_GBps": copy, "bf16_TFLOPs": 2 * n**3 / mm_ms / 1e9, "copy_bytes_rw": nbytes, "matmul_n": n}


def write_model_dir(shape: dict, tokenizer_dir: str) -> str:
    """config.json + the tokenizer, its vocab padded to the model's with synthetic tokens (' w<id>') so every
    sampled id streams visible text (SERVE counts text chunks; out-of-vocab ids would decode to '')."""
    path = tempfile.mkdtemp(prefix="conveyor-gpu-")
    for name in os.listdir(tokenizer_dir):
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    with open(os.path.join(path, "tokenizer.json")) as handle:
        tok = json.load(handle)
    vocab = tok["model"]["vocab"]
    vocab.update({f"\u0120w{i}": i for i in range(len(vocab), shape["vocab_size"])})
    for name, data in (("tokenizer.json", tok), ("config.json", shape)):
        with open(os.path.join(path, name), "w") as handle:
            json.dump(data, handle)
    return path


@torch.no_grad()
def engine_config(a: argparse.Namespace, model_dir: str, **kw) -> EngineConfig:
    base = dict(model=model_dir, device=a.device, dtype="bfloat16" if a.device == "cuda" else "float32",
                load_format="dummy", max_num_seqs=256, max_num_batched_tokens=8192)
    return EngineConfig(**{**base, **kw})


async def graphs_vs_eager(a: argparse.Namespace, shape_dir: str) -> dict:
    """Same dummy weights (seed 0), CUDA graphs on vs off: greedy 32 tokens, one at a time and all at once."""
    outs = {}
    for graphs in (True, False):
        engine = await Engine.create(engine_config(a, shape_dir, max_num_seqs=8, num_kv_blocks=4096,
                                                   cuda_graphs=graphs))
        try:
            ps = [p[: 5 + 19 * i] for i, p in enumerate(prompts(6, 100, 3))]
            single = [(await run_one(engine, p, 32))["ids"] for p in ps[:3]]
            batch = [r["ids"] for r in await asyncio.gather(*[run_one(engine, p, 32) for p in ps])]
            checksum = float(engine.loaded.runner.model.model.embed_tokens.weight.float().sum())
            outs[graphs] = (single, batch, checksum, engine.loaded.runner.graphs is not None)
        finally:
            await engine.shutdown()
            del engine
            free_device()
    first = lambda x, y: next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)  # noqa: E731
    (gs, gb, gc_, g_on), (es, eb, ec, e_on) = outs[True], outs[False]
    return {"layers": json.load(open(os.path.join(shape_dir, "config.json")))["num_hidden_layers"],
            "graphs_captured": [g_on, e_on], "same_weights": gc_ == ec,
            "single_identical": gs == es, "single_first_divergence": [first(x, y) for x, y in zip(gs, es)],
            "batch_identical": gb == eb, "batch_first_divergence": [first(x, y) for x, y in zip(gb, eb)]}


async def b1_off(a: argparse.Namespace, model_dir: str, report: dict, limits: dict) -> None:
    """B1 (batch-1 decode, best of 3 after a warm-up) and OFF (all requests at once) on one dummy engine."""
    config = engine_config(a, model_dir)
    engine = await Engine.create(config, progress=lambda m: log(f"  engine: {m}"))
    blocks = engine.cache.capacity
    report["engine_config"] = {k: getattr(config, k) for k in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                                                                "gpu_memory_utilization", "cuda_graphs", "dtype")}
    try:
        if "b1" not in a.skip:
            plen, n = (32, 16) if a.quick else (128, 256)
            ps = prompts(4, plen, 1)
            await run_one(engine, ps[0], n)
            runs = [itl_stats(await run_one(engine, p, n)) for p in ps[1:]]
            best = max(runs, key=lambda r: r["tok_s"])
            report["b1"] = {**best, "runs_tok_s": [r["tok_s"] for r in runs], "prompt_tokens": plen, "new_tokens": n,
                            "limit_tok_s": limits.get("b1"), "kv_blocks": blocks,
                            "frac_of_limit": limits.get("b1") and best["tok_s"] / limits["b1"]}
            log(f"B1 {best['tok_s']:.1f} tok/s (runs {[round(r['tok_s'], 1) for r in runs]})")
            write(a, report)
        if "b1" not in a.skip and a.b1_long_context:  # B1 after a long prompt (recurrent layers do not grow)
            plen = min(a.b1_long_context, engine.loaded.limits.max_model_len - 300)
            long = itl_stats(await run_one(engine, prompts(1, plen, 9)[0], 256))
            report["b1_long"] = {**long, "prompt_tokens": plen, "new_tokens": 256,
                                 "frac_of_b1": report.get("b1") and long["tok_s"] / report["b1"]["tok_s"]}
            log(f"B1 after {plen} prompt tokens: {long['tok_s']:.1f} tok/s (TTFT {long['ttft_ms']:.0f} ms)")
            write(a, report)
        if "off" not in a.skip:
            nreq, plen, n = (8, 64, 8) if a.quick else (a.off_requests, 512, 128)
            await asyncio.gather(*[run_one(engine, p, 8) for p in prompts(min(nreq, 32), plen, 2)])  # warm-up
            report["off"] = await off_run(engine, limits, nreq, plen, n, seed=3)
            log(f"OFF {report['off']['output_tok_s']:.0f} output tok/s in {report['off']['wall_s']:.1f}s")
            if a.device == "cuda" and not a.quick:  # again, with every kernel variant compiled and the allocator warm
                report["off_repeat"] = await off_run(engine, limits, nreq, plen, n, seed=4)
                log(f"OFF repeat {report['off_repeat']['output_tok_s']:.0f} output tok/s")
            write(a, report)
        if "steps" not in a.skip and a.device == "cuda":
            batches = [1, 4] if a.quick else [1, 16, 64, 256]
            report["steps"] = await step_profile(engine, batches, 64 if a.quick else 576)
            steps = {k: v for k, v in report['steps'].items() if not k.startswith('top_kernels') and k != 'prefill'}
            prefill = report["steps"]["prefill"]
            log(f"steps: {json.dumps(steps)}; prefill {prefill['prompts']}x{prefill['prompt_len']}: "
                f"{prefill['device_ms']:.1f} ms")
        if "verify" not in a.skip and a.device == "cuda":  # last: it recaptures the graphs for q <= 8
            report["verify"] = await verify_profile(engine, [1, 64], 64 if a.quick else 576)
            log(f"verify: {json.dumps(report['verify'])}")
    finally:
        await engine.shutdown()
        del engine
        free_device()


def subprocess_json(cmd: list[str], out: str, timeout: float) -> dict:
    """Run a script in its own process group (killed whole on timeout); return the JSON it wrote."""
    log(f"$ {' '.join(cmd)} (timeout {timeout:.0f}s)")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        raise RuntimeError(f"timed out after {timeout:.0f}s; output tail:\n{text[-2000:]}") from None
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"exit {proc.returncode}; output tail:\n{text[-3000:]}")
    with open(out) as handle:
        return {**json.load(handle), "command": " ".join(cmd)}


def kernels(a: argparse.Namespace, ceil: dict | None) -> dict:
    """Triton attention (decode GB/s beside copy bandwidth, prefill TFLOP/s beside matmul) and per-layer ops."""
    from bench.kernel_attention import bench_decode_attention, bench_prefill_attention
    from bench.kernel_ops import bench_ops

    dec_cases = [(1, 1024), (8, 1024)] if a.quick else [(1, 1024), (1, 4096), (64, 1024), (64, 4096), (256, 1024),
                                                        (256, 4096)]
    pre_cases = [(1, 256, 0)] if a.quick else [(1, 4096, 0), (4, 2048, 0), (16, 512, 0), (8, 512, 1536)]
    decode = [bench_decode_attention(batch_size=b, context_len=c, check=b * c <= 64 * 4096) for b, c in dec_cases]
    prefill = [bench_prefill_attention(num_seqs=n, prompt_len=p, prefix_len=q) for n, p, q in pre_cases]
    for row in decode:
        row["frac_of_copy_bw"] = ceil and row["gbps"] / ceil["copy_GBps"]
    for row in prefill:
        row["frac_of_matmul"] = ceil and row["tflops"] / ceil["bf16_TFLOPs"]
    ops = bench_ops(tokens=(1, 64) if a.quick else (1, 256, 2048), intermediate=12288, iters=20 if a.quick else 100)
    return {"decode": decode, "prefill": prefill, "ops": ops}


def peer_ratios(report: dict) -> dict:
    peer, b1, off = report.get("peer", {}), report.get("b1", {}), report.get("off", {})
    ratio = lambda x, y: x / y if x and y else None  # noqa: E731
    return {"b1_ours_over_peer_static": ratio(b1.get("tok_s"), peer.get("hf_b1_static_tok_s")),
            "off_ours_over_peer": ratio(off.get("output_tok_s"), peer.get("hf_off_out_tok_s")),
            "b1_ours_over_peer_dynamic": ratio(b1.get("tok_s"), peer.get("hf_b1_dynamic_tok_s")),
            "off_ours_over_peer_batch": ratio(off.get("output_tok_s"), peer.get("hf_batch_out_tok_s")),
            "b1_ours_over_limit": b1.get("frac_of_limit"), "off_ours_over_estimate": off.get("frac_of_estimate")}


def summary(report: dict) -> None:
    b1, off, peer, c = (report.get(k) or {} for k in ("b1", "off", "peer", "ceilings"))
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\n== {report['device']}  commit {report['env'].get('commit')}  {report['env']['date']} ==")
    print(f"ceilings: copy {fmt(c.get('copy_GBps'), '.0f')} GB/s, bf16 {fmt(c.get('bf16_TFLOPs'), '.0f')} TFLOP/s")
    print(f"{'workload':10s} {'ours':>10s} {'limit':>10s} {'ours/lim':>9s} {'peer':>10s} {'ours/peer':>9s}")
    est = (off.get("estimate") or {}).get("output_tok_s")
    rows = [("B1 tok/s", b1.get("tok_s"), b1.get("limit_tok_s"),
             peer.get("hf_b1_static_tok_s") or peer.get("hf_b1_dynamic_tok_s")),
            ("OFF out/s", off.get("output_tok_s"), est, peer.get("hf_off_out_tok_s") or peer.get("hf_batch_out_tok_s"))]
    for name, ours, lim, p in rows:
        print(f"{name:10s} {fmt(ours):>10s} {fmt(lim):>10s} {fmt(ours and lim and ours / lim, '.2f'):>9s} "
              f"{fmt(p):>10s} {fmt(ours and p and ours / p, '.2f'):>9s}")
    hv = (report.get("correctness") or {}).get("hf_vs_ours", {})
    print(f"correctness: max|dlogit| {fmt(hv.get('prompt_max_abs_diff'), '.3f')}, greedy identical "
          f"{hv.get('greedy_identical')} (first divergence {hv.get('first_divergence')}), nan {hv.get('nan')}; "
          f"graphs==eager {((report.get('correctness') or {}).get('graphs_vs_eager') or {}).get('single_identical')}")
    for lvl in (report.get("serve") or {}).get("levels", []):
        print(f"serve c={lvl['concurrency']:3d} {lvl['output_tok_s']:8.1f} tok/s  ttft p50 {lvl['ttft_ms']['p50']} ms"
              f"  itl p50 {lvl['itl_ms']['p50']} ms p99 {lvl['itl_ms']['p99']} ms")
    for row in (report.get("kernels") or {}).get("decode", []) + (report.get("kernels") or {}).get("prefill", []):
        frac = row.get("frac_of_copy_bw") or row.get("frac_of_matmul")
        print(f"kernel {row['kernel']:7s} " + (f"B={row['batch_size']} ctx={row['context_len']}: {row['gbps']:.0f} GB/s"
              if row["kernel"] == "decode" else f"n={row['num_seqs']} len={row['prompt_len']} prefix="
              f"{row['prefix_len']}: {row['tflops']:.0f} TFLOP/s") + f" ({fmt(frac, '.2f')} of the ceiling)")
    print(f"errors: {sorted(report['errors']) or 'none'}; total {time.perf_counter() - T0:.0f}s")


def write(a: argparse.Namespace, report: dict) -> None:
    with open(a.out, "w") as handle:
        json.dump(report, handle, indent=1, default=str)


def main() -> None:
    out_dir = os.environ.get("OUT", ".")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(out_dir, "gpu_bench.json"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, ".peer", "tokenizer"))
    ap.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    ap.add_argument("--off-requests", type=int, default=256)
    ap.add_argument("--b1-long-context", type=int, default=0, help="also B1 after a prompt of this many tokens")
    ap.add_argument("--serve-requests", type=int, default=0, help="requests per level (0: serve.py's 2 x c, >= 8)")
    ap.add_argument("--serve-args", default="", help="more `conveyor serve` arguments for SERVE")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="the model shape (random weights)")
    ap.add_argument("--quick", action="store_true", help="tiny shape and workloads (dry run of the control flow)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-s", type=float, default=530,
                    help="whole-run budget: SERVE leaves 200 s of it, the peer gets what is left")
    a = ap.parse_args()
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    import triton
    import transformers

    cuda = a.device == "cuda"
    props = torch.cuda.get_device_properties(0) if cuda else None
    report: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "errors": {}, "seconds": {},
                    "env": {"commit": a.commit or git.stdout.strip() or None, "date": time.strftime("%Y-%m-%d %H:%M"),
                            "torch": torch.__version__, "triton": triton.__version__,
                            "transformers": transformers.__version__, "python": sys.version.split()[0],
                            "gpu_memory_gib": props and props.total_memory / 2**30,
                            "sm_count": props and props.multi_processor_count, "argv": sys.argv[1:]}}
    shape = chosen_shape(a.shape, a.quick)  # with --quick the same family, tiny
    params = num_params(shape)
    # B1 reads every weight a token uses once per step: all of a dense model; a MoE model's top-k experts; a
    # hybrid model also reads and writes each GDN layer's recurrent state
    states = state_bytes_per_seq(shape)
    limits: dict = {"shape": shape, "weight_bytes": 2 * params, "state_bytes_per_seq": states,
                    "b1_bytes": 2 * (active_params(shape) if shape.get("num_experts") else params) + 2 * states}
    model_dir = write_model_dir(shape, a.tokenizer)
    small_dir = write_model_dir({**shape, "num_hidden_layers": min(4, shape["num_hidden_layers"])}, a.tokenizer)
    report["model"] = {"shape": shape, "params": params, "weight_bytes": 2 * params, "weights": "dummy (random)",
                       "tokenizer": f"{a.tokenizer} + synthetic tokens up to vocab_size"}
    serve_out, peer_out = (os.path.join(os.path.dirname(os.path.abspath(a.out)), f) for f in ("serve.json",
                                                                                              "hf_peer.json"))
    serve_cmd = [sys.executable, "bench/serve.py", "--model", model_dir, "--out", serve_out,
                 "--server-args", f"--load-format dummy --dtype {'bfloat16' if cuda else 'float32'} --device "
                                  f"{a.device} --max-num-seqs {4 if a.quick else 64} {a.serve_args}".strip(),
                 "--max-concurrency", "4" if a.quick else "64", "--prompt-tokens", "32" if a.quick else "512",
                 "--output-tokens", "8" if a.quick else "128", "--requests-per-level", str(a.serve_requests)]
    # transformers on the same shape: the dense peer from ../shared/tools, the MoE one (same method) from bench/
    peer_cmd = ([sys.executable, "bench/hf_peer_moe.py", "--off-requests", "8" if a.quick else "32",
                 *(["--shape", a.shape] if a.shape != "qwen3-8b" else []),
                 *(["--layers", "4" if shape.get("linear_num_value_heads") else "2", "--skip-static"]
                   if a.quick else [])]
                if shape.get("num_experts") else
                [sys.executable, ".peer/hf_peer.py", "--off-requests", str(16 if a.quick else a.off_requests)])
    peer_cmd += ["--out", peer_out]
    left = lambda: a.budget_s - (time.perf_counter() - T0)  # noqa: E731
    steps: list[tuple[str, Callable[[], object]]] = [
        ("ceilings", lambda: ceilings(a)),
        ("correctness", lambda: correctness(a, shape)),
        ("graphs", lambda: report.setdefault("correctness", {}).update(
            graphs_vs_eager=asyncio.run(graphs_vs_eager(a, small_dir)))),
        ("b1_off", lambda: asyncio.run(b1_off(a, model_dir, report, limits))),
        ("serve", lambda: subprocess_json(serve_cmd, serve_out, min(240.0, max(90.0, left() - 200)))),
        ("kernels", lambda: kernels(a, report.get("ceilings"))),
        ("moe", lambda: moe_kernel(shape, report.get("ceilings")) if shape.get("num_experts") else None),
        ("peer", lambda: subprocess_json(peer_cmd, peer_out, max(60.0, left()))),
    ]
    for name, fn in steps:
        if name in a.skip or (name == "b1_off" and {"b1", "off", "steps", "verify"} <= set(a.skip)):
            continue
        if not cuda and name in ("kernels", "moe", "peer"):
            report[name] = {"skipped": "needs CUDA"}
            continue
        log(f"== {name}")
        t = time.perf_counter()
        try:
            result = fn()
            if result is not None:
                report[name] = result
            if name == "ceilings":
                limits["ceilings"] = result
                limits["b1"] = result["copy_GBps"] * 1e9 / limits["b1_bytes"]
                report["ceilings"]["b1_limit_tok_s"] = limits["b1"]
        except Exception:  # noqa: BLE001 - one section failing must not lose the others
            report["errors"][name] = traceback.format_exc()
            log(f"{name} FAILED:\n{report['errors'][name]}")
        free_device()
        report["seconds"][name] = round(time.perf_counter() - t, 1)
        log(f"{name} done in {report['seconds'][name]}s")
        if name == "peer" and "peer" in report:
            report["peer"]["ratios"] = peer_ratios(report)
        write(a, report)
    for path in (model_dir, small_dir):
        shutil.rmtree(path, ignore_errors=True)
    summary(report)
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
