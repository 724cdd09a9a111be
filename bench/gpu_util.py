"""Small helpers shared by bench/gpu.py and bench/gpu_correctness.py."""
from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from kernels.bench_attention import cuda_time_ms  # noqa: E402

T0 = time.perf_counter()  # the run's start, for log timestamps and the time budget


def log(message: str) -> None:
    print(f"[gpu.py {time.perf_counter() - T0:6.1f}s] {message}", flush=True)


def pct(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else None


def _layer_params(s: dict, experts: int | None = None) -> int:
    """One decoder layer's parameters; for a MoE shape, `experts` of its experts (all by default)."""
    h, kv, nh, d = s["hidden_size"], s["num_key_value_heads"], s["num_attention_heads"], s["head_dim"]
    attention = h * nh * d * 2 + h * kv * d * 2 + 2 * h + 2 * d
    if s.get("num_experts"):
        count = s["num_experts"] if experts is None else experts
        return attention + count * 3 * h * s["moe_intermediate_size"] + s["num_experts"] * h  # + the router
    return attention + 3 * h * s["intermediate_size"]


def num_params(s: dict) -> int:
    """Parameters of a Qwen3 / Qwen3-MoE config (untied: embedding + lm_head)."""
    h = s["hidden_size"]
    return s["vocab_size"] * h * (1 if s["tie_word_embeddings"] else 2) + s["num_hidden_layers"] * _layer_params(s) + h


def active_params(s: dict) -> int:
    """Parameters one token's decode step reads: every layer (a MoE layer: its router and top-k experts),
    the final norm and lm_head; of the embedding only a row."""
    h = s["hidden_size"]
    return s["vocab_size"] * h + s["num_hidden_layers"] * _layer_params(s, s.get("num_experts_per_tok")) + h


def time_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    """Mean ms per call: CUDA events on CUDA, perf_counter elsewhere (after 3 warm-up calls)."""
    if device == "cuda":
        return cuda_time_ms(fn, iters, warmup=3)
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) * 1e3 / iters


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        log(f"device memory held by this process: {torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved")


