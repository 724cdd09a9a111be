"""One step's sampling rows, read into the host arrays and lists that `SamplingBatch.from_rows`
uploads (pipeline/runner/sampling_batch.py). The device thread runs this once per step over every row.

Neutral values encode "off": temperature 1, top_k 0, top_p 1, min_p 0, penalties 1/0/0, logprobs -1.
Greedy rows (temperature < GREEDY_EPS) keep neutral temperature and filters and draw no noise.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

GREEDY_EPS = 1e-5  # temperatures below this are greedy: dividing by them would overflow the logits
_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


@dataclass(slots=True)
class SamplingRows:
    """The rows' parameters as upload-ready arrays (float32 / int64), plus the host-side summaries
    that from_rows would otherwise compute with one more Python pass per row.

    Per row [S]: temperature, min_p, top_k_all, top_p_all, the penalties and num_logprobs. Per filter:
    the rows it touches and their values. Pairs are flat, first every row index, then every second
    value ([2, N] row-major), as the device tensors are shaped; rng_keys is [R, 2] (low, high halves).
    """

    temperature: np.ndarray  # float32 [S]
    any_temperature: bool  # some row's temperature (as a Python float) is not 1.0
    min_p: np.ndarray  # float32 [S]
    any_min_p: bool
    top_k_all: np.ndarray  # int64 [S], 0 = off
    top_p_all: np.ndarray  # float32 [S], 1.0 = off
    repetition_penalty: np.ndarray  # float32 [S]
    presence_penalty: np.ndarray  # float32 [S]
    frequency_penalty: np.ndarray  # float32 [S]
    random_rows: np.ndarray  # int64 [R]
    rng_keys: np.ndarray  # int64 [2R]: per random row, rng_key's low then high 32 bits
    top_k_rows: np.ndarray  # int64 [Rk]
    top_k: np.ndarray  # int64 [Rk]
    top_k_max: int  # 0: no row filters by top-k
    top_p_rows: np.ndarray  # int64 [Rp]
    top_p: np.ndarray  # float32 [Rp]
    top_p_sort_k: int  # > 0 when every top-p row has a top-k: the largest of them
    seen_rows: list[tuple[int, Any]]  # (row, TokenCounts) for the repetition penalty
    counted_rows: list[tuple[int, Any]]  # (row, TokenCounts) for presence/frequency penalties
    bias_index: np.ndarray  # int64 [2N]: rows, then token ids
    bias_values: np.ndarray  # float32 [N]
    suppress_index: np.ndarray  # int64 [2M]: rows, then token ids held back by min_tokens
    grammar_rows: list[tuple[int, Any, int, int]]  # (row, state, previous row, output position)
    forced_index: np.ndarray  # int64 [2F]: rows, then their only allowed token
    num_logprobs: np.ndarray  # int64 [S], -1 = none asked
    max_num_logprobs: int | None  # None: no row asked
    grammar_draft_rows: list[tuple[int, Any, tuple[int, ...]]]  # (row, state, drafts before it): verify rows


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rng_key(seed: int, counter: int) -> int:
    """The 64-bit key of one row's noise: it mixes only (seed, counter), so a row picks the same
    token alone or in any batch, at any position."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (counter & _MASK64))


def _f32(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def _i64(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def gather(rows: list, vocab_size: int, counts_of: Callable[[Any], Any]) -> SamplingRows:
    """One pass over the rows (SamplingRow). counts_of(row): the row's TokenCounts, for penalty rows."""
    num_rows, vocab = len(rows), vocab_size
    temperature, min_p = [1.0] * num_rows, [0.0] * num_rows
    top_k_all, top_p_all = [0] * num_rows, [1.0] * num_rows
    rep, presence, frequency = [1.0] * num_rows, [0.0] * num_rows, [0.0] * num_rows
    random_rows: list[int] = []
    rng_keys: list[tuple[int, int]] = []
    top_k_rows: list[int] = []
    top_k: list[int] = []
    top_p_rows: list[int] = []
    top_p: list[float] = []
    top_p_sort_k: list[int] = []  # per top-p row: its k, or 0 when it has no top-k
    seen_rows: list[tuple[int, Any]] = []
    counted_rows: list[tuple[int, Any]] = []
    bias: list[tuple[int, int, float]] = []
    suppress: list[tuple[int, int]] = []
    grammar_rows: list[tuple[int, Any, int, int]] = []
    grammar_draft_rows: list[tuple[int, Any, tuple[int, ...]]] = []
    forced: list[tuple[int, int]] = []
    num_logprobs = np.full(num_rows, -1, dtype=np.int64)

    for i, row in enumerate(rows):
        p = row.params
        t = 1.0 if p.temperature is None else float(p.temperature)
        if t >= GREEDY_EPS:
            temperature[i] = t
            random_rows.append(i)
            key = rng_key(row.seed, row.counter)
            rng_keys.append((key & _MASK32, key >> 32))
            k = int(p.top_k or 0)  # an integral float (e.g. from generation_config.json) is its int
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
        # Ids outside [0, V) cannot be sampled, so biasing or suppressing them is a no-op;
        # the intake rejects bad logit_bias ids for the client.
        for tok, value in (p.logit_bias or {}).items():
            if 0 <= int(tok) < vocab:
                bias.append((i, int(tok), float(value)))
        num_output = len(row.output_token_ids) if row.num_output_tokens is None else row.num_output_tokens
        if num_output < p.min_tokens:
            # ignore_eos: eos does not end the sequence, so there is nothing to hold back.
            stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | row.eos_token_ids
            suppress += [(i, tok) for tok in sorted(stops) if 0 <= tok < vocab]
        if p.logprobs is not None:
            num_logprobs[i] = p.logprobs
        if row.grammar is not None:
            if row.grammar_drafts:
                grammar_draft_rows.append((i, row.grammar, row.grammar_drafts))
            else:
                grammar_rows.append((i, row.grammar, row.grammar_previous_row, row.counter))
        if row.forced_token is not None and 0 <= row.forced_token < vocab:
            forced.append((i, row.forced_token))

    any_top_p = bool(top_p_rows)
    return SamplingRows(
        temperature=_f32(temperature),
        any_temperature=any(t != 1.0 for t in temperature),
        min_p=_f32(min_p),
        any_min_p=any(min_p),
        top_k_all=_i64(top_k_all),
        top_p_all=_f32(top_p_all),
        repetition_penalty=_f32(rep),
        presence_penalty=_f32(presence),
        frequency_penalty=_f32(frequency),
        random_rows=_i64(random_rows),
        rng_keys=_i64([half for key in rng_keys for half in key]),
        top_k_rows=_i64(top_k_rows),
        top_k=_i64(top_k),
        top_k_max=max(top_k, default=0),
        top_p_rows=_i64(top_p_rows),
        top_p=_f32(top_p),
        top_p_sort_k=max(top_p_sort_k) if any_top_p and min(top_p_sort_k) > 0 else 0,
        seen_rows=seen_rows,
        counted_rows=counted_rows,
        bias_index=_i64([b[j] for j in range(2) for b in bias]),
        bias_values=_f32([b[2] for b in bias]),
        suppress_index=_i64([s[j] for j in range(2) for s in suppress]),
        grammar_rows=grammar_rows,
        forced_index=_i64([f[j] for j in range(2) for f in forced]),
        num_logprobs=num_logprobs,
        max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
        grammar_draft_rows=grammar_draft_rows,
    )
