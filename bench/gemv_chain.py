"""A model's single-row decode projections chained as in a decode step, under each launch choice; JSON out.

    python3 bench/gemv_chain.py --out $OUT/gemv_chain.json [--shape qwen3.5-35b-a3b qwen3-30b-a3b] [--tma-sweep]

Every layer's projections at batch 1 (the mixer's input projection with the residual-add norm inside it, the
output projection, the router with the norm inside and the normed rows written), then the lm_head, each reading
the one before's output, one weight set per layer (past L2), replayed from one CUDA graph: what ``gemv_config`` /
``gemv_norm_config`` choose under programmatic dependent launch, measured in the chain the choice is for. Variants:

* ``plain``: no dependent launch, the tiles chosen without it;
* ``pdl_whole_rows``: PDL with ``CONVEYOR_GEMV_WHOLE_ROWS=1`` (a program's whole rows of W loaded before it waits);
* ``pdl_tiles_first``: the default under PDL: the tiles chosen without it, the first tile loaded before the wait;
* ``pdl_tiles``: PDL with those tiles, nothing loaded before the wait;
* ``pdl_whole_rows_half``: whole rows, half as many a program (twice the programs, half the registers);
* ``pdl_whole_rows_8warps``: whole rows over 8 warps (half the registers a thread, more programs resident);
* ``tma``: ``CONVEYOR_GEMV_TMA=1`` without dependent launch, every projection (``GEMV_TMA_MIN_BYTES`` = 0) on the
  persistent TMA kernel (kernels/triton_gemv_tma.py) with ``tma_config``'s launch parameters;
* ``pdl_tma``: the same under PDL (each program's first W tile loaded before the wait);
* ``pdl_tma_large``: ``CONVEYOR_GEMV_TMA=1`` as it ships: the TMA kernel for weights of ``GEMV_TMA_MIN_BYTES`` and
  more, the default kernel for the rest, PDL.

``--sweep`` adds ``pdl_tiles_first`` with other tiles: ``sweep:norm=BNxBKwW`` sets the projections with the norm
inside (the router too), ``sweep:plain=...`` the plain ones and the lm_head, one at a time around the defaults
(``p0``: nothing loaded before the wait). ``--tma-sweep`` adds ``pdl_tma_large`` with other TMA launch parameters:
``tma_sweep:norm=BNxBKsSpP`` for its projections with the norm inside, ``tma_sweep:plain=...`` for the others (tile
[BN, BK], S stages, P programs an SM, BN capped at N; a trailing ``L``: the next kernel launched at the end of the
main loop instead of at the start).

A variant that fails (compile or run) records its error and the others go on.

The attention, MoE and recurrent kernels between the projections are left out: this isolates the projections.
Outputs are checked against the plain variant's (close, not equal: tiles change the order of the sums).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.triton_gemv as tg  # noqa: E402
import kernels.triton_gemv_tma as ttma  # noqa: E402
from kernels.bench_attention import cuda_time_ms  # noqa: E402

# per layer kind: (name, N, K, with the norm inside (and the normed rows written))
LAYERS = {
    "qwen3-30b-a3b": [("attention", 48, [("qkv", 5120, 2048, "norm"), ("o", 2048, 4096, "plain"),
                                         ("router", 128, 2048, "norm_keep")]),
                      ("head", 1, [("lm_head", 151936, 2048, "head")])],
    "qwen3.5-35b-a3b": [
        ("gated_deltanet", 30, [("in_proj", 12352, 2048, "norm"), ("out", 2048, 4096, "plain"),
                                ("router", 264, 2048, "norm_keep")]),
        ("attention", 10, [("qkv_gate", 9216, 2048, "norm"), ("o", 2048, 4096, "plain"),
                           ("router", 264, 2048, "norm_keep")]),
        ("head", 1, [("lm_head", 248320, 2048, "head")]),
    ],
}
VARIANTS = ("plain", "pdl_whole_rows", "pdl_tiles_first", "pdl_tiles", "pdl_whole_rows_half", "pdl_whole_rows_8warps",
            "tma", "pdl_tma", "pdl_tma_large")
TMA_SWEEP = tuple(f"tma_sweep:norm={t}" for t in ("32x256s3p4", "16x512s3p4", "8x1024s3p4", "32x256s3p64",
                                                  "32x256s4p2", "32x256s3p4L", "16x256s4p4")) + tuple(
    f"tma_sweep:plain={t}" for t in ("8x1024s3p4", "16x512s3p4", "32x256s3p4", "8x1024s3p64", "16x512s3p64",
                                     "8x1024s3p4L", "32x256s4p2"))


SWEEP = tuple(f"sweep:norm={t}" for t in ("8x512w4", "4x512w4", "16x256w4", "8x256w4", "4x1024w4", "2x1024w4",
                                           "16x512w8", "8x512w8", "8x512w2", "8x512w4p0")) + tuple(
    f"sweep:plain={t}" for t in ("2x1024w4", "4x512w4", "8x512w4", "4x1024w4", "8x256w4", "2x1024w8", "2x512w4",
                                 "2x1024w4p0"))


def swept(variant: str, n: int, k: int, norm: bool) -> dict | None:
    """The overrides a ``sweep:`` variant gives one projection (None: the default's)."""
    kind, spec = variant[len("sweep:"):].split("=")
    if (kind == "norm") != norm:
        return None
    tile, warps = spec.removesuffix("p0").split("w")
    bn, bk = (int(v) for v in tile.split("x"))
    out = {"block_n": min(bn, triton_pow2(n)), "block_k": min(bk, triton_pow2(k)), "num_warps": int(warps)}
    if spec.endswith("p0"):
        out["prefetch"] = False
    return out


def triton_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def tma_swept(variant: str, n: int, norm: bool) -> dict | None:
    """The TMA kernel's keywords of a ``tma_sweep:KIND=BNxBKsSpP[L]`` variant for one projection (None: another
    kind's, which keeps the defaults)."""
    kind, spec = variant[len("tma_sweep:"):].split("=")
    if (kind == "norm") != norm:
        return None
    tile, rest = spec.removesuffix("L").split("s")
    stages, pps = rest.split("p")
    bn, bk = (int(v) for v in tile.split("x"))
    return {"block_n": min(bn, triton_pow2(n)), "block_k": bk, "stages": int(stages), "programs_per_sm": int(pps),
            "late_trigger": spec.endswith("L")}


def tiles(variant: str, n: int, k: int, norm: bool) -> dict:
    """Launch keywords of one projection under ``variant``."""
    if variant.startswith("tma_sweep:"):
        return tma_swept(variant, n, norm) or {}
    if variant in ("tma", "pdl_tma", "pdl_tma_large"):  # no overrides: the dispatch to the TMA kernel
        return {}
    if variant.startswith("sweep:"):
        override = swept(variant, n, k, norm)
        if override is not None:
            return override
        variant = "pdl_tiles_first"
    if variant in ("plain", "pdl_whole_rows"):
        return {}
    if variant == "pdl_whole_rows_8warps":
        return {"num_warps": 8}
    if variant == "pdl_whole_rows_half":
        cfg = (tg.gemv_norm_config if norm else tg.gemv_config)(1, n, k, torch.bfloat16, pdl=True)
        return {"block_n": max(1, cfg["block_n"] // 2), "block_k": cfg["block_k"]}
    cfg = (tg.gemv_norm_config if norm else tg.gemv_config)(1, n, k, torch.bfloat16, pdl=False)
    return {"block_n": cfg["block_n"], "block_k": cfg["block_k"], "prefetch": variant == "pdl_tiles_first"}


def build(shape: str, gen: torch.Generator) -> list[tuple[str, int, int, str, torch.Tensor, torch.Tensor]]:
    dev = torch.device("cuda")
    calls = []
    for _, count, projections in LAYERS[shape]:
        for _ in range(count):
            for name, n, k, kind in projections:
                w = (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
                nw = (1 + 0.1 * torch.randn(k, device=dev, generator=gen)).to(torch.bfloat16)
                calls.append((name, n, k, kind, w, nw))
    return calls


def chain(calls, variant: str, x0: torch.Tensor, r0: torch.Tensor) -> torch.Tensor:
    """The step's projections in order; each reads the previous output (the hidden size's first columns)."""
    hidden, residual, mixer_out = x0, r0, x0
    for name, n, k, kind, w, nw in calls:
        kw = tiles(variant, n, k, kind not in ("plain", "head"))
        gemv, gemv_norm = tg.gemv_triton, tg.gemv_norm_triton
        if variant.startswith("tma_sweep:"):  # the TMA kernel with kw where the dispatch would take it
            if w.numel() * w.element_size() >= tg.GEMV_TMA_MIN_BYTES:
                gemv, gemv_norm = ttma.gemv_tma, ttma.gemv_norm_tma
            else:
                kw = {}
        if kind == "head":  # the logits of the last hidden row (the final norm is its own kernel)
            gemv(hidden, w, **kw)
        elif kind == "plain":
            hidden = gemv(mixer_out[:, :k], w, **kw)
        else:
            out = gemv_norm(hidden, residual, nw, 1e-6, w, None, kind == "norm_keep", **kw)
            residual = out.residual
            mixer_out = out.y if kind == "norm" else mixer_out
            if kind == "norm_keep":
                hidden = out.normed
    return hidden


def run_variant(calls, variant: str, x0: torch.Tensor, r0: torch.Tensor) -> tuple[float, torch.Tensor]:
    pdl_on, whole_rows, use_tma, tma_min = tg.pdl_launch, tg.WHOLE_ROWS, tg.GEMV_TMA, tg.GEMV_TMA_MIN_BYTES
    if variant in ("plain", "tma"):
        tg.pdl_launch = lambda t: {}
    tg.WHOLE_ROWS = variant.startswith("pdl_whole_rows")
    tg.GEMV_TMA = "tma" in variant
    if variant in ("tma", "pdl_tma"):
        tg.GEMV_TMA_MIN_BYTES = 0
    try:
        chain(calls, variant, x0, r0)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(calls, variant, x0, r0)
        return cuda_time_ms(graph.replay, iters=7, warmup=1), out.clone()
    finally:
        tg.pdl_launch, tg.WHOLE_ROWS, tg.GEMV_TMA, tg.GEMV_TMA_MIN_BYTES = pdl_on, whole_rows, use_tma, tma_min


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="*", default=sorted(LAYERS), choices=sorted(LAYERS))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "gemv_chain.json"))
    ap.add_argument("--sweep", action="store_true", help="also the tile sweep around the default (SWEEP)")
    ap.add_argument("--tma-sweep", action="store_true", help="also the TMA kernel's launch parameters (TMA_SWEEP)")
    ap.add_argument("--variants", nargs="*", default=None, help="only these (default: all of VARIANTS)")
    ap.add_argument("--tma-min-mib", type=float, default=None,
                    help="GEMV_TMA_MIN_BYTES for pdl_tma_large and the TMA sweep (default: the shipped floor)")
    a = ap.parse_args()
    if a.tma_min_mib is not None:
        tg.GEMV_TMA_MIN_BYTES = int(a.tma_min_mib * (1 << 20))
    report: dict = {"device": torch.cuda.get_device_name(0), "tma_min_bytes": tg.GEMV_TMA_MIN_BYTES, "shapes": {}}
    for shape in a.shape:
        gen = torch.Generator(device="cuda").manual_seed(0)
        calls = build(shape, gen)
        weight_bytes = sum(c[4].numel() * 2 for c in calls)
        x0 = torch.randn(1, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        r0 = torch.randn(1, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        rows, reference = {}, None
        for variant in tuple(a.variants or VARIANTS) + (SWEEP if a.sweep else ()) + (TMA_SWEEP if a.tma_sweep else ()):
            try:
                ms, out = run_variant(calls, variant, x0, r0)
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is reported, not fatal
                rows[variant] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                print(shape, variant, "FAILED", rows[variant]["error"][:300], flush=True)
                continue
            reference = out if reference is None else reference
            err = (out.float() - reference.float()).abs().max().item()
            rows[variant] = {"ms": ms, "GBps": weight_bytes / ms / 1e6, "max_abs_diff_vs_plain": err}
            print(shape, variant, rows[variant], flush=True)
        report["shapes"][shape] = {"weight_bytes": weight_bytes, "projections": len(calls), "variants": rows}
        del calls
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
