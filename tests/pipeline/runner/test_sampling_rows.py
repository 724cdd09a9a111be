"""A step's sampling rows (pipeline/runner/sampling_rows.py) equal a plain per-row reference loop
(kept below, so the module drifting fails here)."""
from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest

import pipeline.runner.sampling_batch as sampling_batch
from pipeline.request import SamplingParams
from pipeline.runner.sampling_batch import SamplingRow
from pipeline.runner import sampling_rows

MODULES = [sampling_rows]
VOCAB = 100

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _rng_key(seed: int, counter: int) -> int:
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (counter & _MASK64))


def reference(rows: list[SamplingRow], vocab: int, counts_of) -> dict[str, Any]:
    """SamplingBatch.from_rows's row loop and host-side summaries as they were, with the arrays as its
    _Upload made them (np.asarray to float32 / int64)."""
    num_rows = len(rows)
    temperature, min_p = [1.0] * num_rows, [0.0] * num_rows
    top_k_all, top_p_all = [0] * num_rows, [1.0] * num_rows
    rep, presence, frequency = [1.0] * num_rows, [0.0] * num_rows, [0.0] * num_rows
    random_rows, rng_keys, top_k_rows, top_k, top_p_rows, top_p, top_p_sort_k = [], [], [], [], [], [], []
    seen_rows, counted_rows, bias, suppress, grammar_rows, forced = [], [], [], [], [], []
    grammar_draft_rows = []
    num_logprobs = np.full(num_rows, -1, dtype=np.int64)

    for i, row in enumerate(rows):
        p = row.params
        t = 1.0 if p.temperature is None else float(p.temperature)
        if t >= 1e-5:
            temperature[i] = t
            random_rows.append(i)
            key = _rng_key(row.seed, row.counter)
            rng_keys.append((key & _MASK32, key >> 32))
            k = p.top_k or 0
            has_k = 0 < k < vocab
            if has_k:
                top_k_rows.append(i)
                top_k.append(k)
                top_k_all[i] = k
            if p.top_p is not None and p.top_p < 1.0:
                top_p_rows.append(i)
                top_p.append(float(p.top_p))
                top_p_all[i] = float(p.top_p)
                top_p_sort_k.append(k if has_k else 0)
            if p.min_p:
                min_p[i] = float(p.min_p)
        if p.repetition_penalty is not None and p.repetition_penalty != 1.0:
            rep[i] = float(p.repetition_penalty)
            seen_rows.append((i, counts_of(row)))
        if p.presence_penalty or p.frequency_penalty:
            presence[i], frequency[i] = float(p.presence_penalty), float(p.frequency_penalty)
            counted_rows.append((i, counts_of(row)))
        for tok, value in (p.logit_bias or {}).items():
            if 0 <= int(tok) < vocab:
                bias.append((i, int(tok), float(value)))
        num_output = len(row.output_token_ids) if row.num_output_tokens is None else row.num_output_tokens
        if num_output < p.min_tokens:
            stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | row.eos_token_ids
            suppress += [(i, tok) for tok in sorted(stops) if 0 <= tok < vocab]
        if p.logprobs is not None:
            num_logprobs[i] = p.logprobs
        if row.grammar is not None and row.grammar_drafts:
            grammar_draft_rows.append((i, row.grammar, row.grammar_drafts))
        elif row.grammar is not None:
            grammar_rows.append((i, row.grammar, row.grammar_previous_row, row.counter))
        if row.forced_token is not None and 0 <= row.forced_token < vocab:
            forced.append((i, row.forced_token))

    f32 = lambda values: np.asarray(values, dtype=np.float32)  # noqa: E731
    i64 = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    any_top_p = bool(top_p_rows)
    return dict(
        temperature=f32(temperature), any_temperature=any(t != 1.0 for t in temperature),
        min_p=f32(min_p), any_min_p=any(min_p), top_k_all=i64(top_k_all), top_p_all=f32(top_p_all),
        repetition_penalty=f32(rep), presence_penalty=f32(presence), frequency_penalty=f32(frequency),
        random_rows=i64(random_rows), rng_keys=i64([half for key in rng_keys for half in key]),
        top_k_rows=i64(top_k_rows), top_k=i64(top_k), top_k_max=max(top_k, default=0),
        top_p_rows=i64(top_p_rows), top_p=f32(top_p),
        top_p_sort_k=max(top_p_sort_k) if any_top_p and min(top_p_sort_k) > 0 else 0,
        seen_rows=seen_rows, counted_rows=counted_rows,
        bias_index=i64([b[j] for j in range(2) for b in bias]), bias_values=f32([b[2] for b in bias]),
        suppress_index=i64([s[j] for j in range(2) for s in suppress]), grammar_rows=grammar_rows,
        forced_index=i64([f[j] for j in range(2) for f in forced]), num_logprobs=num_logprobs,
        max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
        grammar_draft_rows=grammar_draft_rows,
    )


class Grammar:
    """A stand-in grammar state (the loop only passes it on)."""

    ended = False


def random_row(rng: random.Random, vocab: int) -> SamplingRow:
    pick = rng.choice
    params = SamplingParams(
        temperature=pick([None, 0, 0.0, 1e-6, 0.7, 1.0, 1.0 + 1e-12, 2]),
        top_k=pick([None, 0, -1, 1, 5, vocab - 1, vocab, vocab + 10, 1 << 70]),
        top_p=pick([None, 0.9, 1.0, 0.3, 1]),
        min_p=pick([None, 0.0, 0, 0.05, 1e-300]),
        repetition_penalty=pick([None, None, 1.0, 1, 1.3]),
        presence_penalty=pick([0.0, 0.0, 0.5, -2]),
        frequency_penalty=pick([0.0, 0.0, 0.25, 1]),
        logit_bias=pick([None, None, {}, {3: 1.5, vocab + 5: 2.0, "7": -1.0, -1: 3.0, "12": 0.1, vocab - 1: 1}]),
        min_tokens=pick([0, 0, 3, 30, 1 << 80]),
        ignore_eos=pick([False, True]),
        stop_token_ids=pick([[], [vocab + 1, 4, 2], [9, 9, 1]]),
        logprobs=pick([None, None, 0, 3, 20]),
    )
    output = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
    grammar = pick([None, None, Grammar()])
    return SamplingRow(
        params=params,
        prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randint(0, 10))],
        output_token_ids=output,
        eos_token_ids=pick([frozenset(), frozenset({2}), frozenset({0, 2, vocab + 3})]),
        seed=pick([0, 1, rng.getrandbits(63), rng.getrandbits(70), -rng.getrandbits(40), _MASK64]),
        counter=pick([0, rng.randrange(1 << 20), rng.getrandbits(64), -1]),
        grammar=grammar,
        grammar_previous_row=rng.randrange(-1, 8) if grammar is not None else -1,
        forced_token=pick([None, None, 0, 5, vocab - 1, vocab, vocab + 7, -1]),
        num_output_tokens=pick([None, 0, len(output), 50]),
        grammar_drafts=pick([(), (), (3,), (4, 1, 9)]) if grammar is not None else (),
    )


def random_rows(seed: int, count: int) -> list[SamplingRow]:
    rng = random.Random(seed)
    return [random_row(rng, VOCAB) for _ in range(count)]


def counts_marker(row: SamplingRow) -> tuple[str, int]:
    """Stands in for _counts_of: which row's counts were asked for (compared by the lists)."""
    return ("counts", id(row))


def assert_same(result, expected: dict[str, Any]) -> None:
    names = [f.name for f in dataclasses.fields(result)]
    assert names == list(expected)
    for name in names:
        got, want = getattr(result, name), expected[name]
        if isinstance(want, np.ndarray):
            assert isinstance(got, np.ndarray), name
            assert (got.dtype, got.shape) == (want.dtype, want.shape), name
            assert got.tobytes() == want.tobytes(), name  # bit for bit, float32 rounding included
        else:
            assert type(got) is type(want) and got == want, name


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("seed", range(12))
def test_rows_equal_the_reference_loop(module, seed):
    rows = random_rows(seed, 1 + seed * 25)  # 1 .. 276 rows; about 1,650 in all
    assert_same(module.gather(rows, VOCAB, counts_marker), reference(rows, VOCAB, counts_marker))


@pytest.mark.parametrize("module", MODULES)
def test_typical_decode_rows(module):
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, seed=7)
    rows = [SamplingRow(greedy if i % 3 else sampled, [], list(range(i)), frozenset({2}), 1000 + i, i,
                        grammar=Grammar() if i % 5 == 0 else None, grammar_previous_row=i % 4 - 1,
                        num_output_tokens=i if i % 2 else None)
            for i in range(300)]
    assert_same(module.gather(rows, 32000, counts_marker), reference(rows, 32000, counts_marker))


@pytest.mark.parametrize("module", MODULES)
def test_no_rows(module):
    assert_same(module.gather([], VOCAB, counts_marker), reference([], VOCAB, counts_marker))


@pytest.mark.parametrize("module", MODULES)
def test_integral_float_top_k_counts_as_its_int(module):
    """The one deliberate difference from the old loop: it kept 5.0 as a float (and topk then failed)."""
    row = SamplingRow(SamplingParams(temperature=1.0, top_k=5.0, top_p=0.5), [], [], frozenset(), 0, 0)
    result = module.gather([row], VOCAB, counts_marker)
    assert result.top_k.tolist() == [5] and result.top_k_all.tolist() == [5]
    assert type(result.top_k_max) is int and result.top_k_max == 5 and result.top_p_sort_k == 5


def test_rng_key_is_the_reference_splitmix():
    from pipeline.runner.sampling_rows import rng_key

    rng = random.Random(0)
    for _ in range(200):
        seed, counter = rng.getrandbits(80) - (1 << 79), rng.getrandbits(70) - (1 << 69)
        assert rng_key(seed, counter) == _rng_key(seed, counter)
    assert sampling_batch.rng_key is rng_key
