"""Where a batch-1 decode step's time goes on the critical path: the step's CUDA graph replayed with one part taken
out (or launched another way), against the step as it is; JSON out.

    python3 bench/b1_ablation.py --shape qwen3-30b-a3b --out $OUT/b1_ablation.json [--context 256]

Profiler self-times overlap under programmatic dependent launch (a kernel starts before the one it waits on ends),
so they do not say what removing a kernel would save. Here each variant recaptures the batch-1 graph with a part
replaced by nothing (its output buffer as it was, no kernel), replays it, and reports the replay time beside the
unchanged step's. The outputs of a variant are wrong; only its time is read. Variants:

* ``attention``: no decode attention kernels (the query stands in for the output);
* ``splits=N``: decode attention with N KV splits at batch 1 (the graph's plan; 1 runs no reduce kernel);
* ``prologue``: no q/k norm + rope + KV write kernel;
* ``route``: no routing kernel (the first step's expert choice, kept);
* ``experts``: no expert kernels (the routed and folded shared experts);
* ``conv`` / ``delta_rule``: no Gated DeltaNet conv / recurrence kernel (hybrid shapes);
* ``reduce_from_len=0|1``: the decode attention's reduce with the used splits from the row's length (its two loads
  together) or from the log-sum-exps (``REDUCE_USED_FROM_LEN``); the outputs are right;
* ``skip_empty=0|1``: the decode attention's splits past a row's keys skip their loads and stores, or not
  (``SKIP_EMPTY_SPLITS``, with ``REDUCE_USED_FROM_LEN``); the outputs are right;
* ``decode_block_n=N``: the decode attention's keys a tile (``DECODE_BLOCK_N``); the outputs are right;
* ``small_whole_rows=0|1``: a norm-GEMV too small to fill the GPU (the router) on whole-row tiles, or the table's
  (``SMALL_WHOLE_ROWS``); the outputs are right;
* ``short=N``: the decode reduce takes its short tile for rows of at most N splits (``REDUCE_SHORT_SPLITS``); the
  outputs are right;
* ``gate_up=BN,BK,W[,S]`` / ``down=BN,BK,W``: the MoE decode kernels' launch config at batch 1 (``decode_config``:
  block over outputs, block over the reduced dim, warps; gate/up's stages); the outputs are right.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels.gdn as gdn  # noqa: E402
import pipeline.models.layers as layers  # noqa: E402
import pipeline.models.moe as moe  # noqa: E402
import pipeline.runner.cuda_graphs as cuda_graphs  # noqa: E402
from kernels import dispatch, triton_decode_attention, triton_gemv, triton_moe_decode  # noqa: E402
from pipeline.engine import Engine  # noqa: E402

from gpu import engine_config, write_model_dir  # noqa: E402
from gpu_shapes import SHAPES  # noqa: E402
from gpu_steps import _device_ms, decode_plan  # noqa: E402


@contextlib.contextmanager
def patched(owner: object, name: str, value: object):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def kept_first(fn):
    """``fn`` computed once per argument shape (eagerly, before capture) and its result returned ever after."""
    memo: dict = {}

    def wrapper(x, *args, **kwargs):
        key = (tuple(x.shape), args)
        if key not in memo:
            memo[key] = fn(x, *args, **kwargs)
        return memo[key]
    return wrapper


def variant(name: str) -> contextlib.AbstractContextManager:
    if "+" in name:  # several at once
        stack = contextlib.ExitStack()
        for part in name.split("+"):
            stack.enter_context(variant(part))
        return stack
    if name == "step":
        return contextlib.nullcontext()
    if name == "attention":
        return patched(layers, "paged_attention_triton", lambda q, *args, **kwargs: q)
    if name.startswith("splits="):
        n = int(name.split("=")[1])
        return patched(cuda_graphs, "decode_num_splits", lambda *args, **kwargs: n)
    if name == "prologue":
        return patched(dispatch, "qkv_prologue", lambda *args, **kwargs: None)
    if name == "route":
        return patched(moe, "route_topk", kept_first(moe.route_topk))
    if name == "experts":
        return patched(moe, "fused_moe", kept_first(lambda x, *args: torch.zeros_like(x)))
    if name == "conv":
        return patched(gdn, "causal_conv1d_varlen", lambda x, *args, **kwargs: x)
    if name == "delta_rule":
        return patched(gdn, "gated_delta_rule", lambda q, k, v, *args, **kwargs: torch.empty(
            v.shape, dtype=v.dtype, device=v.device))
    if name.startswith(("gate_up=", "down=")):
        part, config = name.split("=")
        config = tuple(int(v) for v in config.split(","))
        default = triton_moe_decode.decode_config
        return patched(triton_moe_decode, "decode_config", lambda t, k=8: (
            (config, default(t, k)[1]) if part == "gate_up" else (default(t, k)[0], config)))
    if name.startswith("decode_block_n="):
        return patched(triton_decode_attention, "DECODE_BLOCK_N", int(name.split("=")[1]))
    if name.startswith("short="):
        return patched(triton_decode_attention, "REDUCE_SHORT_SPLITS", int(name.split("=")[1]))
    knobs = {"small_whole_rows": (triton_gemv, "SMALL_WHOLE_ROWS"),
             "reduce_from_len": (triton_decode_attention, "REDUCE_USED_FROM_LEN"),
             "skip_empty": (triton_decode_attention, "SKIP_EMPTY_SPLITS")}
    if name.split("=")[0] in knobs:
        owner, attribute = knobs[name.split("=")[0]]
        return patched(owner, attribute, name.split("=")[1] == "1")
    raise ValueError(f"unknown variant {name}")


@torch.inference_mode()
def ablate(runner, variants: list[str], context: int, max_model_len: int, iters: int) -> dict:
    forward = decode_plan(1, context, runner.block_size, fed=False).forward
    rows: dict = {}
    for name in variants:  # a name given twice is measured twice (run-to-run noise): the second as name#2
        with variant(name):
            runner.capture_decode_graphs(1, max_model_len)
            graphs = runner.graphs
            key = name if name not in rows else f"{name}#{sum(k.split('#')[0] == name for k in rows) + 1}"
            rows[key] = min(_device_ms(lambda: graphs.run(forward), iters) for _ in range(3))
    base = rows.get("step")
    return {name: {"replay_ms": ms, "saves_ms": None if base is None else base - ms} for name, ms in rows.items()}


async def main_async(a: argparse.Namespace) -> dict:
    shape = SHAPES[a.shape]
    model_dir = write_model_dir(shape, a.tokenizer)
    engine = await Engine.create(engine_config(a, model_dir, max_num_seqs=1, max_num_batched_tokens=2048,
                                               num_kv_blocks=4096))
    try:
        runner = engine.loaded.runner
        max_model_len = runner.graphs.max_blocks * runner.block_size
        hybrid = bool(shape.get("linear_num_value_heads"))
        variants = ["step", "attention", "splits=1", "splits=4", "splits=16", "prologue", "route", "experts"]
        variants += ["conv", "delta_rule"] if hybrid else []
        variants = a.variants or variants
        result = await engine.executor.call(lambda: ablate(runner, variants, a.context, max_model_len, a.iters))
        return {"device": torch.cuda.get_device_name(0), "shape": a.shape, "context": a.context,
                "max_model_len": max_model_len, "commit": a.commit, "date": time.strftime("%Y-%m-%d %H:%M"),
                "variants": result}
    finally:
        await engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the decoded one")
    ap.add_argument("--variants", nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tokenizer", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), ".peer", "tokenizer"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "b1_ablation.json"))
    a = ap.parse_args()
    report = asyncio.run(main_async(a))
    with open(a.out, "w") as handle:
        json.dump(report, handle, indent=1)
    for name, row in report["variants"].items():
        print(f"{a.shape} {name:12s} {row['replay_ms']:.3f} ms  saves {row['saves_ms'] or 0:+.3f}")


if __name__ == "__main__":
    main()
