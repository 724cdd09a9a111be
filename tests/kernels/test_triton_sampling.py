"""Sort-free top-k / top-p / min-p cutoffs (kernels/triton_sampling.py) against the sort-based reference.

The kernel must keep exactly the reference's set ``{x >= cutoff}``. Its top-p masses are float32 sums in another
order than the reference's float64 cumsum, so every top-p case here is checked (``_assert_margin``) to sit at least
1e-5 away from a boundary where the two could legitimately disagree. On CPU the kernel runs under the Triton
interpreter (small vocabularies); the ``gpu`` test runs a real vocabulary.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import kernels.triton_sampling as sampling
from bench.kernel_sampling import bench_cutoff
from kernels.triton_sampling import (
    apply_cutoff_,
    topk_topp_minp_cutoff_ref,
    topk_topp_minp_cutoff_triton,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
NEG_INF = float("-inf")


@pytest.fixture(params=[0, 16, None], ids=["cap0", "cap16", "cap_default"])
def cap(request, monkeypatch):
    """The compaction buffer size: 0 never copies (every pass reads the row), 16 copies after a few passes, the
    default (2048 >= every V here) copies on the first pass."""
    if request.param is not None:
        monkeypatch.setattr(sampling, "_CAP", request.param)
    return request.param


def _logits(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "float":
        x = torch.randn(rows, vocab, generator=gen) * 2
    elif kind == "int":  # many duplicates: ties everywhere, including at the k-th value
        x = torch.randint(-4, 4, (rows, vocab), generator=gen).float()
    elif kind == "neginf":  # tokens masked earlier (the first stays finite)
        x = torch.randint(-3, 3, (rows, vocab), generator=gen).float()
        x[torch.rand(rows, vocab, generator=gen) < 0.4] = NEG_INF
        x[:, 0] = 1.5
    else:  # "equal"
        x = torch.full((rows, vocab), 0.25)
    return x.to(DEVICE)


def _assert_margin(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, tol: float = 1e-5) -> None:
    """The test data is meaningful: no top set of the survivors has a mass within ``tol`` of p."""
    t_k = topk_topp_minp_cutoff_ref(logits, top_k, torch.ones_like(top_p), torch.zeros_like(top_p))
    for x, cut, p in zip(logits.double().cpu(), t_k.cpu(), top_p.tolist()):
        if p >= 1.0 or x.max() == NEG_INF:
            continue
        ranked = x[x >= cut].sort(descending=True).values
        cumulative = (ranked - ranked[0]).exp().cumsum(0)
        last_of_value = torch.ones_like(ranked, dtype=torch.bool)
        last_of_value[:-1] = ranked[1:] != ranked[:-1]
        masses = cumulative[last_of_value] / cumulative[-1]  # mass of {x >= v} for each distinct survivor value v
        assert (masses - p).abs().min() > tol, f"p={p} is within {tol} of a top-set mass: pick another p"


def _check(logits: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    top_k = torch.as_tensor(top_k, dtype=torch.long, device=logits.device)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device)
    min_p = torch.as_tensor(min_p, dtype=torch.float32, device=logits.device)
    _assert_margin(logits, top_k, top_p)
    before = logits.clone()
    cutoff = topk_topp_minp_cutoff_triton(logits, top_k, top_p, min_p)
    expected = topk_topp_minp_cutoff_ref(logits, top_k, top_p, min_p)
    assert torch.equal(logits, before), "the logits must not be modified"
    assert cutoff.dtype == torch.float32 and cutoff.shape == (logits.shape[0],)
    kept, kept_ref = logits >= cutoff[:, None], logits >= expected[:, None]
    bad = (kept != kept_ref).any(dim=-1).nonzero().flatten().tolist()
    assert not bad, f"kept sets differ in rows {bad}: {cutoff[bad].tolist()} vs {expected[bad].tolist()}"
    assert torch.equal(cutoff, expected), f"{cutoff.tolist()} vs {expected.tolist()}"
    assert kept.any(dim=-1).all(), "the top token always stays"
    return cutoff


@pytest.mark.parametrize("kind", ["float", "int", "neginf", "equal"])
@pytest.mark.parametrize("vocab", [1, 5, 64, 1000])
def test_cutoff_matches_reference(kind, vocab, cap):
    """Six rows mixing the features: all off, k=1, k=V-1 + p, k>=V + tiny p, k + p + min-p, p + min-p."""
    rows = [  # (top_k, top_p, min_p)
        (0, 1.0, 0.0),
        (1, 1.0, 0.0),
        (vocab - 1, 0.63, 0.0),
        (vocab + 5, 1e-4, 0.0),
        (min(3, vocab), 0.41, 0.2),
        (0, 0.93, 0.05),
    ]
    top_k, top_p, min_p = zip(*rows)
    cutoff = _check(_logits(kind, len(rows), vocab, seed=vocab), top_k, top_p, min_p)
    assert cutoff[0] == NEG_INF


@pytest.mark.parametrize("seed", range(2))
def test_cutoff_ties_at_kth_value(seed, cap):
    """Integer logits: every k from 1 to V, ties at the k-th value are kept (the kept count can exceed k)."""
    vocab = 16
    logits = _logits("int", vocab, vocab, seed=100 + seed)
    top_k = torch.arange(1, vocab + 1)
    cutoff = _check(logits, top_k, torch.ones(vocab), torch.zeros(vocab))
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (top_k - 1)[:, None].to(DEVICE)).squeeze(1)
    assert torch.equal(cutoff[:-1], kth[:-1]) and cutoff[-1] == NEG_INF  # k = V is off


def test_cutoff_hand_checked():
    """Small cases whose answer is known, so the reference itself is checked too."""
    ties = torch.tensor([[2.0, 2.0, 1.0, 1.0, 1.0, 0.0]] * 3, device=DEVICE)
    cutoff = _check(ties, [2, 3, 6], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    assert cutoff.tolist() == [2.0, 1.0, NEG_INF]
    assert (ties >= cutoff[:, None]).sum(dim=-1).tolist() == [2, 5, 6]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4, device=DEVICE).log()
    cutoff = _check(probs, [0, 0, 0, 2], [0.45, 0.6, 0.9, 0.9], [0.0, 0.0, 0.0, 0.0])
    assert (probs >= cutoff[:, None]).sum(dim=-1).tolist() == [1, 2, 3, 2]
    cutoff = _check(probs[:2], [0, 0], [1.0, 1.0], [0.2, 0.35])  # keep prob >= min_p * 0.5
    assert (probs[:2] >= cutoff[:, None]).sum(dim=-1).tolist() == [3, 2]


def test_cutoff_degenerate_rows(cap):
    """All equal (with every feature on), a single finite token, all -inf, and +-0.0 ties."""
    logits = torch.full((4, 64), NEG_INF, device=DEVICE)
    logits[0] = 3.0
    logits[1, 17] = -2.0
    logits[3, ::2], logits[3, 1::2] = 0.0, -0.0
    cutoff = _check(logits, [5, 5, 5, 3], [0.5, 0.5, 0.5, 0.5], [0.1, 0.1, 0.1, 0.0])
    assert cutoff[0] == 3.0 and cutoff[1] == -2.0 and cutoff[2] == NEG_INF and cutoff[3] == 0.0
    assert (logits >= cutoff[:, None]).sum(dim=-1).tolist() == [64, 1, 64, 64]


def test_cutoff_strided_and_half_input(cap):
    """A row-strided view and bf16 logits give the reference's answer on the same values."""
    wide = _logits("float", 3, 130, seed=7)
    view = wide[:, 1:101]
    _check(view, [10, 0, 99], [0.8, 0.37, 1.0], [0.0, 0.1, 0.0])
    _check(view.to(torch.bfloat16).float(), [10, 0, 99], [0.8, 0.37, 1.0], [0.0, 0.1, 0.0])


def test_apply_cutoff():
    logits = _logits("float", 3, 64, seed=3)
    cutoff = topk_topp_minp_cutoff_triton(logits, torch.tensor([5, 0, 0]), torch.tensor([1.0, 0.5, 1.0]),
                                          torch.tensor([0.0, 0.0, 0.0]))
    expected = logits.masked_fill(logits < cutoff[:, None], NEG_INF)
    out = apply_cutoff_(logits, cutoff)
    assert out is logits and torch.equal(logits, expected)
    assert torch.isfinite(logits).sum(dim=-1)[0] == 5 and torch.isfinite(logits[2]).all()


@pytest.mark.gpu
def test_gpu_cutoff_full_vocab():
    """V=151936 on the GPU: peaked rows (so top-p boundaries are well separated) and flat ones with top-k."""
    vocab, rows = 151936, 8
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([8.0, 6.0, 5.0, 4.0, 1.0, 1.0, 2.0, 0.5])[:, None]
    logits = (torch.randn(rows, vocab, generator=gen) * scale).cuda()
    logits[5, :50000] = NEG_INF
    top_k = [0, 50, 0, 1000, 20, 0, vocab - 1, 0]
    top_p = [0.9, 0.9, 0.5, 0.93, 0.8, 1.0, 1.0, 1.0]
    min_p = [0.0, 0.0, 0.01, 0.0, 0.0, 0.1, 0.0, 0.0]
    _check(logits, top_k, top_p, min_p)
    stats = bench_cutoff(S=4, iters=2)
    assert {"S", "V", "triton_ms", "sort_ms", "triton_topk_ms", "sort_topk_ms"} <= stats.keys()
    assert math.isfinite(stats["triton_ms"])
