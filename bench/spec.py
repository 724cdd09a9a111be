"""Speculative decoding on one engine shape: decode throughput with the verify rows against plain decoding, per
drafter and K, and whether the tokens stay those of plain decoding on this device. JSON out.

    python3 bench/spec.py --shape qwen3-8b --method replay --modes forced --errors 1.0 --ks 1 2 3 4 5 6 7 \\
        --commit $(git rev-parse --short HEAD) --out $OUT/spec.json
    python3 bench/spec.py --shape qwen3.5-35b-a3b --method mtp --modes forced real --ks 1 2 3 4 --batches 1
    python3 bench/spec.py --shape qwen3.5-35b-a3b --method dflash --modes forced --ks 1 2 3 4 --batches 1 16
    python3 bench/spec.py --quick --device cpu --method draft      # the control flow, on a tiny shape

Random weights make real drafts useless, so each drafter runs in up to two modes:

- ``real``: drafts verified as served (``replay``: drafts replaying the plain run's own output, each wrong with
  probability ``error``; ``--errors 1.0`` is a drafter that is never right);
- ``forced``: every draft taken as if accepted (pipeline/spec/replay.py says why), the verify mechanism's upper bound
  at full acceptance with the drafter's own cost (for ``mtp``, ``dflash`` and ``draft`` their forwards run as
  served; ``dflash`` is a random drafter of an assumed shape, ``dflash_shape``).

For each batch size: a plain run (one token a step, one step ahead), then each K and mode. Per run: decode tok/s
(output tokens after the first over the time from the first request's first token to the last one's last, the
batch's rate), the drafts' acceptance, tokens per verify row, and per request the first output position where the
tokens differ from the plain run's (None: equal; forced runs differ by construction).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.engine import Engine  # noqa: E402
from pipeline.spec.replay import ReplayDrafter  # noqa: E402

from gpu import engine_config, write_model_dir  # noqa: E402
from gpu_requests import prompts, run_one  # noqa: E402
from gpu_shapes import QWEN3_8B, add_engine_args, chosen_shape  # noqa: E402

# Qwen3-0.6B: a draft model of the Qwen3 family (the 8B's tokenizer and vocabulary)
QWEN3_0_6B = dict(QWEN3_8B, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)

def dflash_shape(target: dict) -> dict:
    """A DFlash drafter for ``target`` (random weights, so only its shape matters): five Qwen3 layers at the target's
    hidden size, 128-wide heads, blocks of 16, the reference's default spread of tapped layers. An assumed shape in
    the style of the published drafters, not a published config."""
    size, target_layers = target["hidden_size"], target["num_hidden_layers"]
    head_dim = min(128, size)
    heads = size // head_dim
    dflash = dict(mask_token_id=target["vocab_size"] - 1)
    if target_layers < 8:  # (--quick) one draft layer on the first
        dflash["target_layer_ids"] = [0]
    return dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=size, intermediate_size=3 * size,
                num_hidden_layers=5 if target_layers >= 8 else 1, num_attention_heads=heads,
                num_key_value_heads=min(8, heads), head_dim=head_dim, vocab_size=target["vocab_size"],
                rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
                block_size=16, num_target_layers=target_layers, dflash_config=dflash)


QUICK_DRAFT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=64)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


async def batch_run(engine: Engine, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    results = await asyncio.gather(*[run_one(engine, p, new_tokens) for p in batch])
    first = min(r["stamps"][0][0] for r in results)
    last = max(r["stamps"][-1][0] for r in results)
    tokens = sum(len(r["ids"]) - 1 for r in results)
    return [r["ids"] for r in results], tokens / (last - first)


def drafters(engine_drafter, method: str, modes: list[str], errors: list[float], continuations: dict):
    """(label, drafter) for each run of one K."""
    for mode in modes:
        if method == "replay":
            if mode == "forced":
                yield "forced", ReplayDrafter(continuations, 0.0, forced=True)
            else:
                for error in errors:
                    yield f"error {error}", ReplayDrafter(continuations, error)
        else:
            engine_drafter.accepts_all = mode == "forced"
            yield mode, engine_drafter


async def profile_run(engine: Engine, batch: list[list[int]], new_tokens: int, drafter, k: int, out: str) -> None:
    """One run under torch.profiler: the ops by host and device time, and a Chrome trace, beside ``out``."""
    import torch

    engine.decode.drafter, engine.decode.draft_budget.k = drafter, k
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    await engine.executor.call(prof.__enter__)  # on the device thread: the host ops it records are that thread's
    await batch_run(engine, batch, new_tokens)
    await engine.executor.call(lambda: prof.__exit__(None, None, None))
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    if torch.cuda.is_available():
        table += "\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    with open(out.replace(".json", "-profile.txt"), "w") as handle:
        handle.write(table)
    prof.export_chrome_trace(out.replace(".json", "-trace.json"))


async def workloads(engine: Engine, sizes: dict, a: argparse.Namespace) -> list[dict]:
    decode, out = engine.decode, []
    served = decode.drafter
    await batch_run(engine, prompts(2, sizes["prompt"], 1), 16)  # warm-up
    for batch_size in sizes["batches"]:
        batch = prompts(batch_size, sizes["prompt"], 100 + batch_size)
        decode.drafter = None  # plain decoding, one step ahead
        plain, plain_rate = await batch_run(engine, batch, sizes["new"])
        out.append({"batch": batch_size, "k": 0, "tok_s": plain_rate})
        print(json.dumps(out[-1]), flush=True)
        continuations = {tuple(p): ids for p, ids in zip(batch, plain)}
        if a.profile_plain and batch_size == sizes["batches"][0]:
            await profile_run(engine, batch, sizes["new"], None, 0, a.out)
        elif a.profile and batch_size == sizes["batches"][0]:
            await profile_run(engine, batch, sizes["new"], next(drafters(served, a.method, a.modes, a.errors,
                                                                          continuations))[1], a.ks[0], a.out)
        for k in a.ks:
            for label, drafter in drafters(served, a.method, a.modes, a.errors, continuations):
                decode.drafter = drafter
                decode.draft_budget.k = k
                before = dataclasses.replace(decode.spec, accepted_per_row=list(decode.spec.accepted_per_row))
                ids, rate = await batch_run(engine, batch, sizes["new"])
                spec = decode.spec
                drafted = spec.drafted_tokens - before.drafted_tokens
                accepted = spec.accepted_tokens - before.accepted_tokens
                rows = spec.verify_rows - before.verify_rows
                out.append({"batch": batch_size, "k": k, "drafter": drafter.name, "mode": label, "tok_s": rate,
                            "vs_plain": rate / plain_rate, "verify_rows": rows,
                            "acceptance": accepted / drafted if drafted else None,
                            "tokens_per_row": (accepted + rows) / rows if rows else None,
                            "first_difference": [first_difference(x, y) for x, y in zip(ids, plain)]})
                print(json.dumps({key: v for key, v in out[-1].items() if key != "first_difference"}), flush=True)
    if served is not None:
        served.accepts_all = False
    decode.drafter = served
    return out


def route_to_the_same_experts() -> None:
    """``--same-experts``: every token of every MoE layer goes to experts 0..k-1 (its routing weights and shared
    slot as computed), so a verify row reads one token's expert bytes: the best case of expert locality. Real
    checkpoints route consecutive tokens to overlapping experts; random weights route them anywhere."""
    import torch

    import pipeline.models.moe as moe_block

    routed = moe_block.route_topk

    def same(logits, top_k, renormalize, shared_expert_id=None):
        weights, ids = routed(logits, top_k, renormalize, shared_expert_id)
        ids[:, :top_k] = torch.arange(top_k, dtype=ids.dtype, device=ids.device)
        return weights, ids

    moe_block.route_topk = same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(ap, "spec.json")
    ap.add_argument("--method", default="replay", choices=["replay", "ngram", "mtp", "dflash", "draft"])
    ap.add_argument("--modes", nargs="+", default=["forced", "real"], choices=["forced", "real"])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 7])
    ap.add_argument("--errors", type=float, nargs="+", default=[1.0], help="replay drafts' error rates (real mode)")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--new-tokens", type=int, default=None, help="output tokens per request (default 256)")
    ap.add_argument("--profile", action="store_true", help="profile the first batch's first drafter run")
    ap.add_argument("--profile-plain", action="store_true", help="profile the first batch's plain run instead")
    ap.add_argument("--gil-switch-interval", type=float, default=None, metavar="SECONDS",
                    help="EngineConfig.gil_switch_interval_s (default: the engine's)")
    ap.add_argument("--exact-speculation", action="store_true",
                    help="verify rows computed as one-token decode rows (EngineConfig.exact_speculation)")
    ap.add_argument("--same-experts", action="store_true",
                    help="every token to the same experts (route_to_the_same_experts): expert locality's best case")
    a = ap.parse_args()
    if a.same_experts:
        route_to_the_same_experts()
    shape = chosen_shape(a.shape, a.quick)
    sizes = dict(prompt=32, new=24, batches=[1, 4]) if a.quick else dict(prompt=128, new=256, batches=[1, 16, 64])
    sizes["batches"] = a.batches or sizes["batches"]
    sizes["new"] = a.new_tokens or sizes["new"]
    model_dir = write_model_dir(shape, a.tokenizer)
    draft_dir = None
    options: dict = dict(speculative_method="ngram" if a.method == "replay" else a.method,
                         exact_speculation=a.exact_speculation)
    if a.gil_switch_interval is not None:
        options["gil_switch_interval_s"] = a.gil_switch_interval
    if a.method == "draft":
        draft_dir = write_model_dir(dict(QWEN3_0_6B, **(QUICK_DRAFT if a.quick else {}),
                                         vocab_size=shape["vocab_size"]), a.tokenizer)
        options["speculative_model"] = draft_dir
    if a.method == "dflash":
        draft_dir = write_model_dir(dflash_shape(shape), a.tokenizer)
        options["speculative_model"] = draft_dir
        report_drafter = dflash_shape(shape)
    report: dict = {"shape": a.shape, "quick": a.quick, "commit": a.commit, "method": a.method,
                    "same_experts": a.same_experts,
                    "exact_speculation": a.exact_speculation, "gil_switch_interval_s": a.gil_switch_interval,
                    "date": time.strftime("%Y-%m-%d %H:%M"), "sizes": sizes}
    if a.method == "dflash":
        report["drafter_shape"] = report_drafter
    try:
        import torch

        report["device"] = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"

        async def run() -> list[dict]:
            # prefix caching off: a repeated prompt would start from its cached blocks, its first token computed
            # by a one-token row instead of the prompt's last, which on a GPU is a different bf16 sum
            engine = await Engine.create(engine_config(a, model_dir, max_num_seqs=max(sizes["batches"]),
                                                       max_model_len=max(1024, sizes["prompt"] + sizes["new"] + 64),
                                                       num_speculative_tokens=max(a.ks),
                                                       prefix_caching=False, **options))
            try:
                return await workloads(engine, sizes, a)
            finally:
                await engine.shutdown()

        report["runs"] = asyncio.run(run())
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
        if draft_dir is not None:
            shutil.rmtree(draft_dir, ignore_errors=True)
    with open(a.out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
