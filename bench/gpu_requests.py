"""Requests through a dummy engine for bench/gpu.py and the benches beside it: one greedy request with a timestamp
per delta (``run_one``), random prompts, decode rate and inter-token latency of one request (``itl_stats``), and
OFF: every request at once against the prefill-FLOPs + decode-bytes estimate, with the device steps' timeline.
"""
from __future__ import annotations

import asyncio
import random
import time

import torch

from pipeline.engine import Engine
from pipeline.request import SamplingParams

from gpu_util import active_params, layer_kinds, pct


async def run_one(engine: Engine, prompt: list[int], n: int) -> dict:
    """One greedy ignore_eos request: ids and a timestamp per delta."""
    start, stamps, ids = time.perf_counter(), [], []
    # random weights repeat themselves: the loop guard would end requests early, so it is off here
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, repetition_detection=False)
    async for delta in engine.generate(prompt_token_ids=prompt, params=params):
        stamps.append((time.perf_counter(), len(delta.token_ids)))
        ids.extend(delta.token_ids)
    return {"start": start, "stamps": stamps, "ids": ids}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 150000) for _ in range(length)] for _ in range(n)]


def itl_stats(r: dict) -> dict:
    """Decode tok/s = (n - 1) / (t_last - t_first); ITL per token from delta timestamps (merged deltas split)."""
    (t_first, _), (t_last, _) = r["stamps"][0], r["stamps"][-1]
    gaps = [(s - q) / k for (q, _), (s, k) in zip(r["stamps"], r["stamps"][1:]) for _ in range(k)] or [0.0]
    return {"tok_s": (len(r["ids"]) - 1) / (t_last - t_first), "ttft_ms": (t_first - r["start"]) * 1e3,
            "tokens": len(r["ids"]), "itl_ms": {"mean": sum(gaps) / len(gaps) * 1e3, "p50": pct(gaps, 50) * 1e3,
                                                "p99": pct(gaps, 99) * 1e3}}


async def off_run(engine: Engine, limits: dict, nreq: int, plen: int, n: int, seed: int) -> dict:
    """All requests at once: output tok/s against the estimate, TTFT, and the steps by kind."""
    timeline = StepTimeline(engine.executor)
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0
    before, start = engine.stats(), time.perf_counter()
    res = await asyncio.gather(*[run_one(engine, p, n) for p in prompts(nreq, plen, seed)])
    wall, after = time.perf_counter() - start, engine.stats()
    timeline.detach()
    out, ttft = sum(len(r["ids"]) for r in res), [r["stamps"][0][0] - start for r in res]
    est = off_estimate(limits, nreq, plen, n)
    return {"requests": nreq, "prompt_tokens": plen, "output_tokens": n, "generated": out, "wall_s": wall,
            "output_tok_s": out / wall, "total_tok_s": (out + nreq * plen) / wall,
            "ttft_s": {"p50": pct(ttft, 50), "max": max(ttft)}, "estimate": est,
            "frac_of_estimate": est and out / wall / est["output_tok_s"], "kv_blocks": engine.cache.capacity,
            **{k: after[k] - before[k] for k in ("device_steps", "mixed_steps", "preemptions")},
            "alloc_retries": (torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
                              if torch.cuda.is_available() else 0),
            "steps_by_kind": timeline.summary(start)}


class StepTimeline:
    """Wraps the executor's launch to record, per device step, when its launch began and ended on the device
    thread (the launch returns once the kernels are queued, so the gaps between launches are the step cadence)
    and what it held. ``summary`` groups the steps by kind: prefill (prompt tokens only), mixed, decode."""

    def __init__(self, executor) -> None:
        self.executor, self.inner, self.steps = executor, executor._launch, []

        def launch(plan, previous, previous_host):
            begin = time.perf_counter()
            sample = self.inner(plan, previous, previous_host)
            forward = plan.forward
            self.steps.append((begin, time.perf_counter(), int(forward.num_tokens), int(len(forward.logits_indices))))
            return sample

        executor._launch = launch

    def detach(self) -> None:
        self.executor._launch = self.inner

    def summary(self, start: float) -> dict:
        kinds: dict = {}
        for i, (begin, end, tokens, logits) in enumerate(self.steps):
            kind = "decode" if tokens == logits else "prefill" if logits * 64 < tokens else "mixed"
            gap = (self.steps[i + 1][0] if i + 1 < len(self.steps) else begin) - begin
            entry = kinds.setdefault(kind, {"steps": 0, "tokens": 0, "cadence_s": 0.0, "launch_s": 0.0})
            entry["steps"] += 1
            entry["tokens"] += tokens
            entry["cadence_s"] += gap
            entry["launch_s"] += end - begin
        kinds["first_launch_s"] = self.steps[0][0] - start if self.steps else None
        kinds["last_launch_s"] = self.steps[-1][0] - start if self.steps else None
        # (launch began s, launch took s, tokens, logits rows): the first steps and the slowest launches
        row = lambda b, e, t, n: (round(b - start, 4), round(e - b, 4), t, n)  # noqa: E731
        kinds["first_20"] = [row(*s) for s in self.steps[:20]]
        kinds["slowest_5"] = [row(*s) for s in sorted(self.steps, key=lambda s: s[0] - s[1])[:5]]
        return kinds


def off_estimate(limits: dict, nreq: int, plen: int, n: int) -> dict | None:
    """Prefill FLOPs at the matmul rate + decode bytes (weights + KV read per step) at copy bandwidth."""
    c, s = limits.get("ceilings"), limits["shape"]
    if not c:
        return None
    h, kvh, d, nh = (s[k] for k in ("hidden_size", "num_key_value_heads", "head_dim", "num_attention_heads"))
    layers = layer_kinds(s).count("full_attention")  # KV and quadratic attention: the attention layers only
    linear = active_params(s) - s["vocab_size"] * h  # per-token matmul params (a MoE layer: its top-k experts)
    attn = 4 * layers * nh * d * plen * (plen + 1) // 2  # causal QK^T + PV per request
    flops = nreq * (2 * linear * plen + attn + 2 * s["vocab_size"] * h)  # + lm_head for the last prompt token
    kv_token = layers * 2 * kvh * d * 2
    # the first output token comes from prefill; decode step i reads the weights and plen + i + 1 tokens of KV
    # (a hybrid model's recurrent states: read and written once per sequence per step)
    states = 2 * nreq * limits.get("state_bytes_per_seq", 0)
    decode_bytes = sum(limits["weight_bytes"] + nreq * (plen + i + 1) * kv_token + states for i in range(n - 1))
    t_pre, t_dec = flops / (c["bf16_TFLOPs"] * 1e12), decode_bytes / (c["copy_GBps"] * 1e9)
    return {"prefill_flops": flops, "decode_bytes": decode_bytes, "prefill_s": t_pre, "decode_s": t_dec,
            "output_tok_s": nreq * n / (t_pre + t_dec), "total_tok_s": nreq * (n + plen) / (t_pre + t_dec)}
