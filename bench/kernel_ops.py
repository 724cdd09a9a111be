"""Microbenchmarks of the per-layer Triton ops against their eager torch references (CUDA events, GB/s).

``python -m bench.kernel_ops`` (from the repository root) prints one line per (op, impl, tokens). Importable on
CPU; running needs CUDA.
Two times per case: ``eager_us`` (back-to-back Python calls: host launch overhead included, what an eager
prefill pays) and ``graph_us`` (the calls replayed from one CUDA graph: GPU time, what graphed decode pays).
GB/s counts the unavoidable bytes (each input read once, each output written once) over ``graph_us``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.triton_activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.kv_cache import write_kv_ref
from kernels.triton_kv_cache import write_kv_triton
from kernels.triton_norm import rms_norm_ref, rms_norm_triton
from kernels.triton_rope import apply_rotary_ref_, apply_rotary_triton_
from pipeline.models.rope import RotaryEmbedding


def time_cuda(fn: Callable[[], object], iters: int = 100, warmup: int = 10, graph: bool = False) -> float:
    """Mean microseconds per call by CUDA events: ``iters`` eager calls, or one graph of ``iters`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run = None
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for _ in range(iters):
                fn()
        cuda_graph.replay()
        run = cuda_graph.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    if run is not None:
        run()
    else:
        for _ in range(iters):
            fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def bench_ops(
    tokens: tuple[int, ...] = (1, 64, 2048),
    hidden: int = 4096,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    intermediate: int = 14336,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 100,
) -> list[dict]:
    """Time every op at each token count (Llama-3-8B shapes by default); one dict per (op, impl, tokens)."""
    device = torch.device("cuda")
    elt = torch.tensor([], dtype=dtype).element_size()
    rope = RotaryEmbedding(head_dim, head_dim, 8192, 500000.0, dtype=dtype, device=device)
    results = []
    for t in tokens:
        x = torch.randn(t, hidden, dtype=dtype, device=device)
        res = torch.randn_like(x)
        weight = torch.randn(hidden, dtype=dtype, device=device)
        qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
        q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(t, kv_heads, head_dim)
        cos, sin = rope.cos_sin(torch.randint(0, 8192, (t,), device=device))
        gate_up = torch.randn(t, 2 * intermediate, dtype=dtype, device=device)
        num_blocks = max(64, 2 * t // block_size + 1)
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        slots = torch.randperm(num_blocks * block_size, device=device)[:t]
        cases = {
            "rms_norm+residual": (4 * t * hidden * elt,
                                  lambda: rms_norm_triton(x, weight, 1e-6, res),
                                  lambda: rms_norm_ref(x, weight, 1e-6, res)),
            "rope_qk": (2 * t * (heads + kv_heads + 1) * head_dim * elt,
                        lambda: apply_rotary_triton_(q, k, cos, sin, True),
                        lambda: apply_rotary_ref_(q, k, cos, sin, True)),
            "silu_and_mul": (3 * t * intermediate * elt,
                             lambda: silu_and_mul_triton(gate_up),
                             lambda: silu_and_mul_ref(gate_up)),
            "write_kv": (4 * t * kv_heads * head_dim * elt,
                         lambda: write_kv_triton(k, v, cache, slots),
                         lambda: write_kv_ref(k, v, cache, slots)),  # padded ref syncs: not capturable
        }
        for op, (nbytes, triton_fn, ref_fn) in cases.items():
            for impl, fn in (("triton", triton_fn), ("torch", ref_fn)):
                eager_us = time_cuda(fn, iters)
                graph_us = time_cuda(fn, iters, graph=True)
                results.append({"op": op, "impl": impl, "tokens": t, "eager_us": eager_us, "graph_us": graph_us,
                                "gbps": nbytes / graph_us / 1e3})
    return results


def main() -> None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    print(f"# {name}")
    for row in bench_ops():
        print(f"{row['op']:18s} {row['impl']:6s} T={row['tokens']:5d}  eager {row['eager_us']:7.2f} us"
              f"  graph {row['graph_us']:7.2f} us {row['gbps']:7.0f} GB/s")


if __name__ == "__main__":
    main()
