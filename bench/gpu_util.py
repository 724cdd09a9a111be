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

from bench.kernel_attention import cuda_time_ms  # noqa: E402

T0 = time.perf_counter()  # the run's start, for log timestamps and the time budget


def log(message: str) -> None:
    print(f"[gpu.py {time.perf_counter() - T0:6.1f}s] {message}", flush=True)


def pct(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else None


def layer_kinds(s: dict) -> list[str]:
    """Each layer's mixer: a hybrid shape's layer_types (every full_attention_interval-th attends), else all
    attention."""
    if s.get("layer_types"):
        return list(s["layer_types"])
    if s.get("linear_num_value_heads"):
        every = s.get("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(s["num_hidden_layers"])]
    return ["full_attention"] * s["num_hidden_layers"]


def _gdn_dims(s: dict) -> tuple[int, int, int]:
    """(key dim, value dim, conv channels) of a Gated DeltaNet layer."""
    key = s["linear_num_key_heads"] * s["linear_key_head_dim"]
    value = s["linear_num_value_heads"] * s["linear_value_head_dim"]
    return key, value, 2 * key + value


def _layer_params(s: dict, experts: int | None = None, kind: str = "full_attention") -> int:
    """One decoder layer's parameters; for a MoE shape, `experts` of its experts (all by default)."""
    h, kv, nh, d = s["hidden_size"], s["num_key_value_heads"], s["num_attention_heads"], s["head_dim"]
    if kind == "linear_attention":
        _, value, conv = _gdn_dims(s)
        heads = s["linear_num_value_heads"]
        mixer = h * (conv + value + 2 * heads) + conv * s.get("linear_conv_kernel_dim", 4) + value * h + 2 * h
    else:  # q (and its output gate on hybrid shapes), k, v, o
        gate = 2 if s.get("linear_num_value_heads") else 1
        mixer = h * nh * d * (1 + gate) + h * kv * d * 2 + 2 * h + 2 * d
    if s.get("num_experts"):
        count = s["num_experts"] if experts is None else experts
        shared = 3 * h * s["shared_expert_intermediate_size"] + h if s.get("shared_expert_intermediate_size") else 0
        return mixer + count * 3 * h * s["moe_intermediate_size"] + s["num_experts"] * h + shared  # + the router
    return mixer + 3 * h * s["intermediate_size"]


def num_params(s: dict) -> int:
    """Parameters of a Qwen3 / Qwen3-MoE / hybrid config (untied: embedding + lm_head)."""
    h = s["hidden_size"]
    layers = sum(_layer_params(s, None, kind) for kind in layer_kinds(s))
    return s["vocab_size"] * h * (1 if s["tie_word_embeddings"] else 2) + layers + h


def active_params(s: dict) -> int:
    """Parameters one token's decode step reads: every layer (a MoE layer: its router, top-k experts and shared
    expert), the final norm and lm_head; of the embedding only a row."""
    h = s["hidden_size"]
    top_k = s.get("num_experts_per_tok")
    return s["vocab_size"] * h + sum(_layer_params(s, top_k, kind) for kind in layer_kinds(s)) + h


def state_bytes_per_seq(s: dict) -> int:
    """A sequence's recurrent state (hybrid shapes): per GDN layer the fp32 delta-rule state and the bf16 conv
    window. Decode reads and writes it once per token."""
    if not s.get("linear_num_value_heads"):
        return 0
    _, _, conv = _gdn_dims(s)
    ssm = s["linear_num_value_heads"] * s["linear_key_head_dim"] * s["linear_value_head_dim"] * 4
    per_layer = ssm + conv * (s.get("linear_conv_kernel_dim", 4) - 1) * 2
    return per_layer * layer_kinds(s).count("linear_attention")


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


