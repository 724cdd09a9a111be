"""Each logits-pipeline step against a naive per-row Python reference, on mixed rows."""
from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch

from pipeline.request import SamplingParams as P
from pipeline.runner import logits_pipeline as lp
from pipeline.runner.sampling_batch import GREEDY_EPS, SamplingBatch, SamplingRow

V = 1000
CPU = torch.device("cpu")
NEG_INF = float("-inf")


class FakeGrammar:
    """Stands in for a GrammarState: allows a fixed set of token ids."""

    ended = False

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for token in self.allowed:
            word, bit = divmod(token, 32)
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def make_rows() -> list[SamplingRow]:
    """Greedy rows, one row per option, rows with several options, and rows with none."""
    gen = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=gen).tolist() + [11, 11, 12]  # some repeats

    params = [
        P(),
        P(temperature=0.0),
        P(temperature=0.0, repetition_penalty=1.3, top_k=5, top_p=0.5, min_p=0.5, logit_bias={4: 2.0}),
        P(temperature=0.7),
        P(top_k=20),
        P(top_p=0.8),
        P(min_p=0.05),
        P(repetition_penalty=1.5),
        P(repetition_penalty=0.8),
        P(presence_penalty=0.7, frequency_penalty=0.4),
        P(logit_bias={5: 3.0, 999: -2.0, V: 1.0}),  # id V does not exist: ignored
        P(min_tokens=5, stop_token_ids=[7, 8]),
        P(min_tokens=5, stop_token_ids=[9], ignore_eos=True),
        P(min_tokens=2, stop_token_ids=[7]),
        P(temperature=1.3, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
          presence_penalty=0.2, frequency_penalty=-0.1, logit_bias={3: -1.0, 11: 0.5}),
        P(top_k=-1, top_p=1.0, min_p=0.0, repetition_penalty=1.0),
        P(temperature=0.5, top_k=0, top_p=0.3),
    ]
    out_lens = {11: 2, 12: 2, 13: 3}
    rows = [
        SamplingRow(p, ids(30), ids(0)[: out_lens[i]] if i in out_lens else ids(8), frozenset({0, 1}), i, 3)
        for i, p in enumerate(params)
    ]
    rows[3].grammar = FakeGrammar({2, 31, 32, 63, 500, 999})  # word edges and the sign bit
    rows[14].grammar = FakeGrammar(set(range(0, V, 3)))
    rows[5].forced_token = 77
    rows[2].forced_token = 4
    return rows


def make_logits(rows: list[SamplingRow], seed: int = 0) -> torch.Tensor:
    return torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * 3


# ---- naive references: one row, a Python list of floats ----

def is_greedy(p: P) -> bool:
    return p.temperature is not None and p.temperature < GREEDY_EPS


def ref_repetition(x: list[float], row: SamplingRow) -> list[float]:
    rp = row.params.repetition_penalty
    if rp is None:
        return x
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    return [(v / rp if v > 0 else v * rp) if t in seen else v for t, v in enumerate(x)]


def ref_presence_frequency(x: list[float], row: SamplingRow) -> list[float]:
    counts = Counter(row.output_token_ids)
    p = row.params
    return [v - p.frequency_penalty * counts[t] - p.presence_penalty * (counts[t] > 0) for t, v in enumerate(x)]


def ref_logit_bias(x: list[float], row: SamplingRow) -> list[float]:
    bias = row.params.logit_bias or {}
    return [v + bias.get(t, 0.0) for t, v in enumerate(x)]


def ref_min_tokens(x: list[float], row: SamplingRow) -> list[float]:
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return x
    banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(row.eos_token_ids))
    return [NEG_INF if t in banned else v for t, v in enumerate(x)]


def ref_grammar(x: list[float], row: SamplingRow) -> list[float]:
    if row.grammar is None:
        return x
    return [v if t in row.grammar.allowed else NEG_INF for t, v in enumerate(x)]


def ref_forced(x: list[float], row: SamplingRow) -> list[float]:
    f = row.forced_token
    if f is None:
        return x
    return [(x[t] if math.isfinite(x[t]) else 0.0) if t == f else NEG_INF for t in range(V)]


def ref_temperature(x: list[float], row: SamplingRow) -> list[float]:
    t = row.params.temperature
    return x if is_greedy(row.params) or t is None else [v / t for v in x]


def ref_top_k(x: list[float], row: SamplingRow) -> list[float]:
    k = row.params.top_k or 0
    if is_greedy(row.params) or not 0 < k < V:
        return x
    kth = sorted(x, reverse=True)[k - 1]  # ties at the k-th value stay
    return [v if v >= kth else NEG_INF for v in x]


def probs_of(x: list[float]) -> list[float]:
    top = max(x)
    e = [math.exp(v - top) for v in x]
    return [v / sum(e) for v in e]


def ref_top_p(x: list[float], row: SamplingRow) -> list[float]:
    p = row.params.top_p
    if is_greedy(row.params) or p is None or p >= 1.0:
        return x
    probs, kept, mass = probs_of(x), set(), 0.0
    for t in sorted(range(V), key=lambda t: -x[t]):
        kept.add(t)
        mass += probs[t]
        if mass >= p:
            break
    return [v if t in kept else NEG_INF for t, v in enumerate(x)]


def ref_min_p(x: list[float], row: SamplingRow) -> list[float]:
    m = row.params.min_p
    if is_greedy(row.params) or not m:
        return x
    probs = probs_of(x)
    return [v if probs[t] >= m * max(probs) else NEG_INF for t, v in enumerate(x)]


STEPS = [
    ("repetition_penalty", lp.apply_repetition_penalty, ref_repetition),
    ("presence_frequency_penalties", lp.apply_presence_frequency_penalties, ref_presence_frequency),
    ("logit_bias", lp.apply_logit_bias, ref_logit_bias),
    ("min_tokens", lp.apply_min_tokens, ref_min_tokens),
    ("grammar_bitmask", lp.apply_grammar_bitmask, ref_grammar),
    ("forced_tokens", lp.apply_forced_tokens, ref_forced),
    ("temperature", lp.apply_temperature, ref_temperature),
    ("truncation", lp.apply_truncation, lambda x, row: ref_min_p(ref_top_p(ref_top_k(x, row), row), row)),
]


def test_truncation_keeps_ties_at_the_kth_value():
    rows = [SamplingRow(P(top_k=2, temperature=1.0), [], [], frozenset(), 0, 0)]
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5]])
    got = lp.apply_truncation(logits.clone(), SamplingBatch.from_rows(rows, 5, CPU))
    assert torch.isfinite(got).tolist() == [[False, True, True, True, False]]


def reference(logits: torch.Tensor, rows: list[SamplingRow], refs) -> torch.Tensor:
    out = []
    for x, row in zip(logits.tolist(), rows):
        for ref in refs:
            x = ref(x, row)
        out.append(x)
    return torch.tensor(out)


def test_steps_are_the_documented_order():
    assert [name for name, _ in lp.LOGITS_STEPS] == [name for name, _, _ in STEPS]


@pytest.mark.parametrize("index", range(len(STEPS)), ids=[s[0] for s in STEPS])
def test_each_step_matches_reference(index):
    rows = make_rows()
    batch = SamplingBatch.from_rows(rows, V, CPU)
    batch.fill_grammar_bitmask()
    # feed each step what the earlier steps produce, as in the pipeline
    logits = reference(make_logits(rows), rows, [ref for _, _, ref in STEPS[:index]])
    _, step, ref = STEPS[index]
    got = step(logits.clone(), batch)
    torch.testing.assert_close(got, reference(logits, rows, [ref]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_whole_pipeline_matches_reference(seed):
    rows = make_rows()
    batch = SamplingBatch.from_rows(rows, V, CPU)
    batch.fill_grammar_bitmask()
    logits = make_logits(rows, seed)
    raw = logits.clone()
    got = lp.apply_logits_pipeline(logits, batch)
    torch.testing.assert_close(got, reference(logits, rows, [ref for _, _, ref in STEPS]), rtol=1e-5, atol=1e-5)
    assert torch.equal(logits, raw)  # the caller's logits stay raw (logprobs need them)


def test_repetition_penalty_hf_semantics():
    row = SamplingRow(P(repetition_penalty=2.0), [1], [2], frozenset(), 0, 0)
    batch = SamplingBatch.from_rows([row], 4, CPU)
    got = lp.apply_repetition_penalty(torch.tensor([[4.0, 4.0, -4.0, -4.0]]), batch)
    assert got.tolist() == [[4.0, 2.0, -8.0, -4.0]]  # prompt and output tokens, sign-aware


def test_presence_frequency_count_output_only():
    row = SamplingRow(P(presence_penalty=1.0, frequency_penalty=0.5), [0, 0, 3], [1, 1, 1, 2], frozenset(), 0, 0)
    batch = SamplingBatch.from_rows([row], 4, CPU)
    got = lp.apply_presence_frequency_penalties(torch.zeros(1, 4), batch)
    assert got.tolist() == [[0.0, -2.5, -1.5, 0.0]]


def test_logit_bias_adds():
    rows = [SamplingRow(P(logit_bias={0: 1.5, 3: -100.0}), [], [], frozenset(), 0, 0),
            SamplingRow(P(), [], [], frozenset(), 0, 0)]
    got = lp.apply_logit_bias(torch.ones(2, 4), SamplingBatch.from_rows(rows, 4, CPU))
    assert got.tolist() == [[2.5, 1.0, 1.0, -99.0], [1.0, 1.0, 1.0, 1.0]]


@pytest.mark.parametrize("generated, suppressed", [(0, True), (2, True), (3, False), (5, False)])
def test_min_tokens_suppresses_eos_and_stop_ids_until_reached(generated, suppressed):
    params = P(min_tokens=3, stop_token_ids=[2])
    row = SamplingRow(params, [5], [4] * generated, frozenset({1}), 0, 0)
    ignore_eos = P(min_tokens=3, stop_token_ids=[2], ignore_eos=True)
    ignoring = SamplingRow(ignore_eos, [5], [4] * generated, frozenset({1}), 0, 0)
    got = lp.apply_min_tokens(torch.zeros(2, 6), SamplingBatch.from_rows([row, ignoring], 6, CPU))
    masked = [-math.inf if suppressed else 0.0]
    assert got[0].tolist() == [0.0] + masked * 2 + [0.0] * 3
    assert got[1].tolist() == [0.0, 0.0] + masked + [0.0] * 3  # ignore_eos: eos is no stop, stays allowed


def test_greedy_rows_skip_temperature_and_filters():
    row = SamplingRow(P(temperature=0.0, top_k=1, top_p=0.01, min_p=0.9), [], [], frozenset(), 0, 0)
    batch = SamplingBatch.from_rows([row], V, CPU)
    logits = make_logits([row])
    assert batch.all_greedy and not (batch.any_top_k or batch.any_top_p or batch.any_min_p or batch.any_temperature)
    assert torch.equal(lp.apply_logits_pipeline(logits, batch), logits)


def test_batch_builds_penalty_statistics_only_when_needed():
    plain = SamplingBatch.from_rows([r for i, r in enumerate(make_rows()) if i in (0, 1, 3, 4, 5, 6, 10)], V, CPU)
    assert plain.seen_mask is None and plain.output_counts is None and not plain.any_penalties
    rows = make_rows()
    batch = SamplingBatch.from_rows(rows, V, CPU)
    batch.fill_grammar_bitmask()
    expected = torch.zeros(len(rows), V)
    for i, row in enumerate(rows):
        if row.params.presence_penalty or row.params.frequency_penalty:
            for t in row.output_token_ids:
                expected[i, t] += 1
    assert torch.equal(batch.output_counts, expected)


def test_shape_mismatch_is_an_error():
    batch = SamplingBatch.from_rows(make_rows(), V, CPU)
    with pytest.raises(ValueError):
        lp.apply_logits_pipeline(torch.zeros(3, V), batch)


def test_top_p_sorts_only_top_k_when_every_row_has_top_k():
    rows = [SamplingRow(P(top_k=k, top_p=0.6), [], [], frozenset(), 0, 0) for k in (3, 40)]
    batch = SamplingBatch.from_rows(rows, V, CPU)
    batch.fill_grammar_bitmask()
    assert batch.top_p_sort_k == 40
    logits = make_logits(rows)
    want = reference(logits, rows, [ref_top_k, ref_top_p])
    torch.testing.assert_close(lp.apply_top_p(lp.apply_top_k(logits.clone(), batch), batch), want)


def truncation_rows(count: int) -> list[SamplingRow]:
    choices = [P(top_k=7), P(top_p=0.6), P(min_p=0.1), P(top_k=30, top_p=0.8, min_p=0.02), P(temperature=0.0), P()]
    return [SamplingRow(choices[i % len(choices)], [], [], frozenset(), i, 0) for i in range(count)]


@pytest.mark.parametrize("device", [
    pytest.param("cpu", id="interpreter"),
    pytest.param("cuda", id="gpu", marks=pytest.mark.gpu),
])
def test_truncation_kernel_keeps_what_the_torch_steps_keep(monkeypatch, device):
    if device == "cpu":
        if not lp.dispatch.triton_available():
            pytest.skip("triton is not installed")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton runs on the GPU here (the conftest sets the interpreter only without CUDA)")
        monkeypatch.setattr(lp.dispatch, "use_triton", lambda d: True)  # the kernel under the interpreter
    monkeypatch.setattr(lp, "CUTOFF_KERNEL_MIN_ROWS", 1)
    vocab = 300 if device == "cpu" else 151936
    rows = truncation_rows(12 if device == "cpu" else 64)
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(len(rows), vocab, generator=gen) * 2).round(decimals=1).to(device)  # many ties
    batch = SamplingBatch.from_rows(rows, vocab, torch.device(device))
    kernel = lp.apply_truncation(logits.clone(), batch)
    steps = lp.apply_min_p(lp.apply_top_p(lp.apply_top_k(logits.clone(), batch), batch), batch)
    differ = [i for i in range(len(rows)) if not torch.equal(torch.isfinite(kernel[i]), torch.isfinite(steps[i]))]
    # only top-p may differ, and only by float32 rounding at its mass boundary
    assert all(rows[i].params.top_p is not None for i in differ) and len(differ) <= len(rows) // 8


SINGLE_OPTIONS = [P(), P(temperature=0.0), P(temperature=1.0), P(temperature=0.7), P(top_k=20), P(top_p=0.8),
                  P(min_p=0.05), P(repetition_penalty=1.5), P(presence_penalty=0.7), P(frequency_penalty=0.4),
                  P(logit_bias={5: 3.0}), P(min_tokens=5, stop_token_ids=[7]), "grammar", "forced"]


@pytest.mark.parametrize("option", range(len(SINGLE_OPTIONS)))
def test_changes_logits_is_whether_a_step_acts(option):
    """``changes_logits`` says, for a row with one option (or none), whether some step changes the logits; when
    it says no, the pipeline hands back the logits without a copy."""
    params = SINGLE_OPTIONS[option]
    row = SamplingRow(params if isinstance(params, P) else P(), [1, 2, 3, 3], [4, 4, 5], frozenset({0, 1}), 0, 3)
    if params == "grammar":
        row.grammar = FakeGrammar({2, 31, 500})
    elif params == "forced":
        row.forced_token = 77
    batch = SamplingBatch.from_rows([row], V, CPU)
    batch.fill_grammar_bitmask()
    logits = make_logits([row])
    acted = False
    for _, step in lp.LOGITS_STEPS:
        acted |= not torch.equal(step(logits.clone(), batch), logits)
    assert lp.changes_logits(batch) == acted
    assert (lp.apply_logits_pipeline(logits, batch) is logits) == (not acted)
