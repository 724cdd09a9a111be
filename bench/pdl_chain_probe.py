"""Does programmatic dependent launch shorten a CUDA-graph chain of single-row decode GEMVs, and how much weight
should a program load before it waits?

    python3 bench/pdl_chain_probe.py   (CUDA, Hopper or later; writes $OUT/pdl_probe.json)

48 layers of the Qwen3-30B-A3B single-row projections (qkv 5120 x 2048, o 2048 x 4096, router 128 x 2048; each
reads the one before's output, 1.8 GB of weights in all, past L2), with a one-program kernel after the router or
not, replayed from one CUDA graph. A self-contained GEMV (not kernels/triton_gemv.py) so the variants stay apart:
plain launches; PDL waiting first; PDL with the first [rows, 512] tile loaded before the wait; PDL with all of a
program's rows loaded before it ([8, 2048] / [4, 4096] tiles); each with and without triggering the dependents at
the start. Every variant's graph output is checked equal to its eager run.
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

out = {"triton": triton.__version__}


@triton.jit
def gemv(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         PDL: tl.constexpr, PRE: tl.constexpr, TRIGGER: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    if TRIGGER:
        gdc_launch_dependents()
    if PRE == 2:
        offs_all = tl.arange(0, K)
        w_all = tl.load(w_ptr + rows[:, None] * K + offs_all[None, :])
        if PDL:
            gdc_wait()
        x_all = tl.load(x_ptr + offs_all).to(tl.float32)
        y = tl.sum(w_all.to(tl.float32) * x_all[None, :], axis=1)
    else:
        w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if PRE == 1:
            w0 = tl.load(w_ptrs)
        if PDL:
            gdc_wait()
        start: tl.constexpr = BLOCK_K if PRE == 1 else 0
        if PRE == 1:
            acc += w0.to(tl.float32) * tl.load(x_ptr + offs_k).to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
        for k in range(start, K, BLOCK_K):
            w = tl.load(w_ptrs)
            x = tl.load(x_ptr + k + offs_k).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            w_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def tiny(x_ptr, y_ptr, N, PDL: tl.constexpr, TRIGGER: tl.constexpr, BLOCK: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
    offs = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (v * 0.5).to(y_ptr.dtype.element_ty), mask=offs < N)


dev = torch.device("cuda")
L = 48
H, QKV, O_IN, R = 2048, 5120, 4096, 128
g = torch.Generator(device=dev).manual_seed(0)
ws = []
for _ in range(L):
    ws.append(((torch.randn(QKV, H, device=dev, generator=g) / H**0.5).bfloat16(),
               (torch.randn(H, O_IN, device=dev, generator=g) / O_IN**0.5).bfloat16(),
               (torch.randn(R, H, device=dev, generator=g) / H**0.5).bfloat16()))
x0 = torch.randn(H, device=dev, generator=g).bfloat16()
bufs = [torch.empty(QKV, device=dev, dtype=torch.bfloat16) for _ in range(L)]
hs = [torch.empty(H, device=dev, dtype=torch.bfloat16) for _ in range(L)]
rs = [torch.empty(R, device=dev, dtype=torch.bfloat16) for _ in range(L)]
ts = [torch.empty(R, device=dev, dtype=torch.bfloat16) for _ in range(L)]
total_bytes = sum(sum(w.numel() * 2 for w in t) for t in ws)


def launch(x, w, y, n, k, pdl, pre, trig, bn=8, bk=512, warps=4):
    kw = {"launch_pdl": True} if pdl else {}
    gemv[(triton.cdiv(n, bn),)](x, w, y, n, K=k, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, PRE=pre, TRIGGER=trig,
                                num_warps=warps, **kw)


def chain(pdl, pre, trig, with_tiny):
    x = x0
    for i in range(L):
        wq, wo, wr = ws[i]
        launch(x, wq, bufs[i], QKV, H, pdl, pre, trig)
        launch(bufs[i], wo, hs[i], H, O_IN, pdl, pre, trig, bn=4)
        launch(hs[i], wr, rs[i], R, H, pdl, pre, trig, bn=2, bk=512)
        if with_tiny:
            kw = {"launch_pdl": True} if pdl else {}
            tiny[(1,)](rs[i], ts[i], R, PDL=pdl, TRIGGER=trig, BLOCK=128, **kw)
        x = hs[i]
    return x.clone()


def timed(pdl, pre, trig, with_tiny):
    ref = chain(pdl, pre, trig, with_tiny)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = chain(pdl, pre, trig, with_tiny)
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(res, ref)
    ts_ = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        ts_.append(s.elapsed_time(e))
    ts_.sort()
    return {"ms": ts_[len(ts_) // 2], "GBps": total_bytes / ts_[len(ts_) // 2] / 1e6, "equal_eager": same}


base = None
for name, cfg in [("plain", (False, 0, False)), ("pdl_wait", (True, 0, False)), ("pdl_wait_trig", (True, 0, True)),
                  ("pdl_pre1", (True, 1, False)), ("pdl_pre1_trig", (True, 1, True)),
                  ("pdl_pre_all", (True, 2, False)), ("pdl_pre_all_trig", (True, 2, True)),
                  ("plain_pre_all", (False, 2, False))]:
    for with_tiny in (False, True):
        key = f"{name}{'+tiny' if with_tiny else ''}"
        try:
            out[key] = timed(*cfg, with_tiny)
        except Exception as exc:  # noqa: BLE001
            out[key] = {"error": repr(exc)[:400]}
        print(key, out[key], flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "pdl_probe.json"), "w"), indent=1)
