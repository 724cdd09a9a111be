"""Top-k / top-p / min-p truncation as one cutoff per row, found without sorting: Triton kernel and torch reference.

Why: each truncation filter keeps the tokens whose logit is >= some threshold, so the three together keep
``{x >= cutoff}`` with ``cutoff = max(t_k, t_p, t_m)``. The sort-based filters sort every row of the [S, V] logits
(V ~152k) to find those thresholds; the kernel instead searches for them over float values, reading the row a
handful of times and never writing it. The sampler then masks ``x < cutoff`` (``apply_cutoff_``) and draws.

Semantics (``topk_topp_minp_cutoff_ref`` is the oracle), on float32 logits already divided by the temperature, which
may hold -inf (tokens masked earlier) but no NaN or +inf:

- top-k, ties inclusive (vLLM): ``t_k`` = the k-th largest value counting duplicates. Off when k <= 0 or k >= V.
- top-p on the top-k survivors ``{x >= t_k}``: ``t_p`` = the largest t whose set ``{x >= t}`` holds softmax mass
  (over the survivors) >= p; the top token always stays, ties with the last kept value stay. Off when p >= 1.
- min-p: ``t_m = max(x) + log(min_p)`` (log 0 = -inf: off).

The kernel: one program per row. Pass 1 takes the row max and min. Each search then keeps an interval
``[lo, hi)`` of float32 values in their monotone int32 encoding (integer order = float order) with the invariant
"lo satisfies, hi does not"; each pass over the row tests NP pivots spread over the interval at once (a count
#(x >= t) >= k for top-k; a mass sum(exp(x - m), x >= t) >= p * Z_k for top-p), shrinking it (NP + 1)-fold, and
counts the values inside. Once at most CAP values remain inside, one pass copies them to a per-row scratch buffer
and the search finishes on those alone. At V=151936 (random logits) that is 6-7 passes over the row in all, not
the 1 + 2 * 32 of a plain bisection; a search that is off for the row costs nothing, and top-p after a top-k of at
most CAP needs only the copying pass. The result ``lo`` is a value present in the row (or -inf), so the
kernel's kept set is the reference's. The one exception is top-p within float32 rounding of the
boundary: the kernel sums exp in float32 in its own order (and on a GPU with the fast exp), the reference in
float64, so when the mass of some top set is within float32 summation error of p (~1e-6 relative at V~152k) the
two may keep sets that differ by that boundary group (a flat row of 152k tokens has such groups ~3e-6 apart).
min-p is exact: both add the same float32 ``log(min_p)`` (taken by torch) to the same max.
"""

from __future__ import annotations


import torch

from kernels.triton_compat import jit as _jit
from kernels.triton_compat import tl, triton

NEG_INF = float("-inf")
# search tile [NP, BLOCK] (the buffer's: [NP_B, BLOCK_B]), max/copy chunk CBLOCK, CAP buffered values per row;
# picked on an H100 at V=151936 for S=1 and S=256
_BLOCK, _NP, _CBLOCK, _CAP, _BLOCK_B, _NP_B = 1024, 4, 4096, 2048, 256, 32
_STAGES = tl.constexpr(3) if tl is not None else 3  # loads in flight per loop (software pipelining): latency


def topk_topp_minp_cutoff_ref(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """The oracle, by sorting: cutoff [S] float32 such that the kept tokens are exactly ``logits >= cutoff``.

    top-p compares the float64 cumulative mass ``c_j`` of the sorted survivors with ``p * Z`` (``Z`` = their total):
    ``t_p`` is the sorted value at the first j with ``c_j >= p * Z``.
    """
    x = logits.float()
    rows, vocab = x.shape
    ninf = torch.full((rows,), NEG_INF, device=x.device)
    ranked = x.sort(dim=-1, descending=True).values
    top = ranked[:, 0]

    k = top_k.to(device=x.device, dtype=torch.long)
    k_on = (k > 0) & (k < vocab)
    kth = ranked.gather(1, (k.clamp(1, vocab) - 1)[:, None]).squeeze(1)
    t_k = torch.where(k_on, kth, ninf)

    p = top_p.to(device=x.device, dtype=torch.float64)
    safe_top = torch.where(top > NEG_INF, top, 0.0).double()  # all -inf row: weights 0, not NaN
    weights = (ranked.double() - safe_top[:, None]).exp().masked_fill(ranked < t_k[:, None], 0.0)
    cumulative = weights.cumsum(dim=-1)
    reached = cumulative >= p[:, None] * cumulative[:, -1:]  # true at the last column for any p <= 1
    first = reached.int().argmax(dim=-1, keepdim=True)  # the first j reaching p
    t_p = torch.where(p < 1.0, ranked.gather(1, first).squeeze(1), ninf)

    t_m = top + min_p.to(device=x.device, dtype=torch.float32).log()
    return torch.maximum(torch.maximum(t_k, t_p), t_m)


def apply_cutoff_(logits: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """Mask every token below its row's cutoff with -inf, in place."""
    return logits.masked_fill_(logits < cutoff[:, None], NEG_INF)


@_jit
def _key(f):
    """float32 -> int64 key, monotone: integer order = float order (-0.0 sits just below +0.0)."""
    b = f.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@_jit
def _value(key):
    """The inverse of ``_key`` (the map is an involution on the int32 bits)."""
    b = key.to(tl.int32)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@_jit
def _stats(src, n, t, t_z, m, MASS: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr):
    """Over ``src[:n]``, per pivot t [NP]: #(x >= t) and (MASS) sum(exp(x - m), x >= t); and the sum over x >= t_z.

    Tiles are [NP, BLOCK]: each x sits in one thread, which tests it against all NP pivots."""
    offs = tl.arange(0, BLOCK)
    cnt = tl.zeros([NP, BLOCK], dtype=tl.int32)
    mass = tl.zeros([NP, BLOCK], dtype=tl.float32)
    z = tl.zeros([BLOCK], dtype=tl.float32)
    for start in tl.range(0, n, BLOCK, num_stages=_STAGES):
        cols = start + offs
        # padding is -inf: below every pivot (pivot > lo >= key(-inf)) and exp(-inf - m) = 0
        x = tl.load(src + cols, mask=cols < n, other=float("-inf"))
        ge = x[None, :] >= t[:, None]
        cnt += ge.to(tl.int32)
        if MASS:
            e = tl.exp(x - m)
            mass += tl.where(ge, e[None, :], 0.0)
            z += tl.where(x >= t_z, e, 0.0)
    return tl.sum(cnt, axis=1), tl.sum(mass, axis=1), tl.sum(z, axis=0)


@_jit
def _search(x_row, V, buf, lo, hi, c_lo, target, m, t_z, MASS: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr,
            CBLOCK: tl.constexpr, CAP: tl.constexpr, BLOCK_B: tl.constexpr, NP_B: tl.constexpr):
    """The largest key in [lo, hi) that satisfies, given that lo does (with ``c_lo`` = #(x >= lo)) and hi does not.

    Count search: #(x >= t) >= target. Mass search: sum(exp(x - m), x >= t) >= target * Z, Z that sum over
    ``x >= t_z`` (the top-k survivors). Each pass tests NP pivots strictly inside (lo, hi). Once [lo, hi) holds at
    most CAP values, one pass copies them to ``buf`` and the rest of the search reads only those (the values
    at or above hi enter as the constants c_hi, w_hi). Returns (lo, #(x >= lo))."""
    j = tl.arange(0, NP).to(tl.int64) + 1
    c_hi = c_lo * 0
    w_hi = tl.sum(tl.zeros([NP], dtype=tl.float32), axis=0)
    z = w_hi
    while (hi - lo > 1) & (c_lo - c_hi > CAP):
        piv = lo + 1 + ((hi - lo - 1) * j) // (NP + 1)  # in (lo, hi); every key once the interval is <= NP wide
        cnt, mass, z = _stats(x_row, V, _value(piv), t_z, m, MASS, BLOCK, NP)
        sat = (mass >= target * z) if MASS else (cnt >= target)
        # sat is monotone over the pivots (true, ..., false): keep the last that satisfies, the first that does not
        lo, hi = tl.max(tl.where(sat, piv, lo), axis=0), tl.min(tl.where(sat, hi, piv), axis=0)
        c_lo, c_hi = tl.min(tl.where(sat, cnt, c_lo), axis=0), tl.max(tl.where(sat, c_hi, cnt), axis=0)
        w_hi = tl.max(tl.where(sat, w_hi, mass), axis=0)
    if hi - lo > 1:
        # compaction: copy the c_lo - c_hi <= CAP values in [lo, hi) to buf, in row order (deterministic)
        t_lo, t_hi = _value(lo), _value(hi)
        offs = tl.arange(0, CBLOCK)
        n = c_lo * 0
        zc = tl.zeros([CBLOCK], dtype=tl.float32)
        for start in tl.range(0, V, CBLOCK, num_stages=_STAGES):
            cols = start + offs
            x = tl.load(x_row + cols, mask=cols < V, other=float("-inf"))
            inside = ((x >= t_lo) & (x < t_hi) & (cols < V)).to(tl.int32)
            pos = n + tl.cumsum(inside, axis=0) - 1
            tl.store(buf + pos, x, mask=(inside != 0) & (pos < CAP))
            n += tl.sum(inside, axis=0)
            if MASS:
                zc += tl.where(x >= t_z, tl.exp(x - m), 0.0)
        if MASS:
            z = tl.sum(zc, axis=0)
        tl.debug_barrier()  # buf's stores are visible to every thread of the program
        c_top, w_top = c_hi, w_hi
        jb = tl.arange(0, NP_B).to(tl.int64) + 1  # more pivots per pass: the buffer is small
        while hi - lo > 1:
            piv = lo + 1 + ((hi - lo - 1) * jb) // (NP_B + 1)
            cnt, mass, _ = _stats(buf, n, _value(piv), t_z, m, MASS, BLOCK_B, NP_B)
            cnt += c_top
            mass += w_top
            sat = (mass >= target * z) if MASS else (cnt >= target)
            lo, hi = tl.max(tl.where(sat, piv, lo), axis=0), tl.min(tl.where(sat, hi, piv), axis=0)
            c_lo, c_hi = tl.min(tl.where(sat, cnt, c_lo), axis=0), tl.max(tl.where(sat, c_hi, cnt), axis=0)
    return lo, c_lo


@_jit
def _cutoff_kernel(
    x_ptr, top_k_ptr, top_p_ptr, log_min_p_ptr, out_ptr, buf_ptr,
    V, x_s0,
    BLOCK: tl.constexpr, NP: tl.constexpr, CBLOCK: tl.constexpr, CAP: tl.constexpr,
    BLOCK_B: tl.constexpr, NP_B: tl.constexpr,
):
    """Grid (S,): one program per row; ``buf_ptr`` is [S, CAP] scratch. See the module docstring."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_s0
    buf = buf_ptr + row * CAP
    offs = tl.arange(0, CBLOCK)
    run_max = tl.full([CBLOCK], float("-inf"), dtype=tl.float32)
    run_min = tl.full([CBLOCK], float("inf"), dtype=tl.float32)
    for start in tl.range(0, V, CBLOCK, num_stages=_STAGES):
        cols = start + offs
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf"))
        run_max = tl.maximum(run_max, x)
        run_min = tl.minimum(run_min, tl.where(cols < V, x, float("inf")))
    m = tl.max(run_max, axis=0)
    key_min = _key(tl.min(run_min, axis=0))
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)

    # top-k: the largest t with #(x >= t) >= k; lo = min always satisfies (#= V >= k), just above max never does
    k_on = (k > 0) & (k < V)
    lo_k = tl.where(k_on, key_min, -2139095041)  # off: the key of -inf (bits 0xFF800000 ^ 0x7FFFFFFF)
    hi_k = tl.where(k_on, _key(m) + 1, lo_k + 1)
    n_all = (k * 0 + V).to(tl.int32)  # #(x >= min), a tensor even where V is specialized to a constant
    lo_k, c_k = _search(x_row, V, buf, lo_k, hi_k, n_all, k, m, 0.0, False, BLOCK, NP, CBLOCK, CAP, BLOCK_B, NP_B)
    t_k = _value(lo_k)

    # top-p over the survivors: lo = t_k (or the min) holds all their mass, just above max holds none
    p_on = (p < 1.0) & (m > float("-inf"))
    lo_p = tl.maximum(lo_k, key_min)
    hi_p = tl.where(p_on, _key(m) + 1, lo_p + 1)
    lo_p, _ = _search(x_row, V, buf, lo_p, hi_p, c_k, p, m, t_k, True, BLOCK, NP, CBLOCK, CAP, BLOCK_B, NP_B)
    t_p = tl.where(p_on, _value(lo_p), float("-inf"))

    t_m = m + tl.load(log_min_p_ptr + row)
    tl.store(out_ptr + row, tl.maximum(tl.maximum(t_k, t_p), t_m))


def topk_topp_minp_cutoff_triton(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Same contract as ``topk_topp_minp_cutoff_ref``: [S, V] logits (last dim contiguous), per-row parameters."""
    x = logits.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0 or vocab == 0:
        return out.fill_(NEG_INF)
    dev = x.device
    log_min_p = min_p.to(device=dev, dtype=torch.float32).log()  # torch's log, as the reference: min-p exact
    buf = torch.empty(rows, max(_CAP, 1), dtype=torch.float32, device=dev)
    _cutoff_kernel[(rows,)](
        x, top_k.to(device=dev, dtype=torch.long).contiguous(), top_p.to(device=dev, dtype=torch.float32).contiguous(),
        log_min_p.contiguous(), out, buf, vocab, x.stride(0),
        BLOCK=min(triton.next_power_of_2(vocab), _BLOCK), NP=_NP, CBLOCK=min(triton.next_power_of_2(vocab), _CBLOCK),
        CAP=_CAP, BLOCK_B=min(triton.next_power_of_2(max(_CAP, 1)), _BLOCK_B), NP_B=_NP_B,
        num_warps=16 if rows < 128 else 4,  # few rows: each program has an SM to itself, so more warps per row
    )
    return out
