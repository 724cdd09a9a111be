"""The per-step batch of sampling rows: built on the host once per step, read on the device.

Each row is one token to pick for one sequence (a decode step, the first token after prefill, or
one position of a speculative verify). `SamplingBatch.from_rows` turns the rows' parameters into
device tensors once, and records host-side flags (`all_greedy`, `top_k_max`, ...) so the logits
pipeline can skip whole steps without a device sync.

Neutral values encode "off": temperature 1, top_k disabled, top_p 1, min_p 0, penalties 1/0/0.
Greedy rows (temperature < GREEDY_EPS) get neutral temperature and filters: their token is the
argmax of the penalized/biased logits, which top-k/top-p/min-p could not change anyway.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

import ext
from pipeline.request import SamplingParams
from pipeline.runner.host_staging import HostStaging

_penalties = ext.load("penalties")

GREEDY_EPS = 1e-5  # temperatures below this are greedy: dividing by them would overflow the logits
_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rng_key(seed: int, counter: int) -> int:
    """The 64-bit key of one row's noise. Nothing but (seed, counter) feeds a draw, so a row picks
    the same token alone or in any batch, at any position."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (counter & _MASK64))


def depends_on_output_tokens(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a sequence's next row reads the values of its earlier outputs (penalties) or its exact
    output count (min_tokens still holding eos back), so its previous token must reach the host
    before the next step is planned."""
    return (params.repetition_penalty not in (None, 1.0) or bool(params.presence_penalty)
            or bool(params.frequency_penalty) or num_output_tokens < params.min_tokens)


@dataclass(slots=True)
class SamplingRow:
    """One token to pick for one sequence."""

    params: SamplingParams  # resolved by the engine; None fields still mean neutral
    prompt_token_ids: Sequence[int]  # for penalties when `counts` is None (else may be empty)
    output_token_ids: Sequence[int]  # generated so far; for penalties (when `counts` is None) and min_tokens
    eos_token_ids: frozenset[int]  # suppressed while len(output) < min_tokens, unless ignore_eos
    seed: int  # per-sequence seed (the engine draws one when the request has none)
    counter: int  # RNG counter: the output position of the token being picked
    grammar: Any = None  # GrammarState: its bitmask is filled by the runner while the forward runs
    # >= 0: the stage may not have recorded the token sampled in this row of its previous step yet
    # (one step ahead; that token's output position is counter - 1): the runner takes it from there
    grammar_previous_row: int = -1
    forced_token: int | None = None  # the only token this row may pick (e.g. closing a thinking budget)
    counts: Any = None  # the sequence's TokenCounts (ext/penalties), kept up to date per token
    num_output_tokens: int | None = None  # None: len(output_token_ids)


@dataclass(slots=True)
class SamplingBatch:
    """Device tensors for one step of S rows over a vocabulary of V.

    `*_rows` index tensors name the rows a filter touches; None means every row.
    """

    num_rows: int
    vocab_size: int
    device: torch.device
    # temperature [S] float32, 1.0 for greedy and neutral rows
    temperature: Tensor
    any_temperature: bool
    # random rows: indices [R] and their noise keys [R, 2] (low, high 32 bits of rng_key)
    random_rows: Tensor
    rng_keys: Tensor
    num_random: int
    # top-k: k [Rk] int64 for the rows in top_k_rows; top_k_max == 0 means no row filters
    top_k: Tensor
    top_k_rows: Tensor | None
    top_k_max: int
    # top-p: p [Rp] float32; top_p_sort_k > 0 when every top-p row also has top-k (sort only that many)
    top_p: Tensor
    top_p_rows: Tensor | None
    any_top_p: bool
    top_p_sort_k: int
    # the same per row for the truncation kernel: k [S] int64 (0 = off), p [S] float32 (1.0 = off)
    top_k_all: Tensor
    top_p_all: Tensor
    # min-p [S] float32, 0.0 = off
    min_p: Tensor
    any_min_p: bool
    # penalties [S] float32 and their per-step token statistics [S, V] (None when unused)
    repetition_penalty: Tensor
    presence_penalty: Tensor
    frequency_penalty: Tensor
    seen_mask: Tensor | None  # bool: token occurs in prompt or output (repetition penalty rows)
    output_counts: Tensor | None  # float32: occurrences in the output (presence/frequency rows)
    # sparse edits: logit_bias (indices [2, N], values [N]) and min_tokens suppression ([2, M])
    bias_index: Tensor | None
    bias_values: Tensor | None
    suppress_index: Tensor | None
    # logprobs: per-row count on the host (-1 = none asked), max over rows (None = no row asked)
    num_logprobs: np.ndarray
    max_num_logprobs: int | None
    # grammar rows (host states) and their bitmask [S, ceil(V/32)] int32, set by the runner after
    # the forward is launched (fill_grammar_bitmask); forced tokens as indices [2, F]
    # (row, state, previous row, output position being picked)
    grammar_rows: list[tuple[int, Any, int, int]] = field(default_factory=list)
    grammar_bitmask: Tensor | None = None
    forced_index: Tensor | None = None
    staging: HostStaging | None = None  # the runner's reused host buffers (the bitmask's too)

    def fill_grammar_bitmask(self, previous_tokens: Callable[[], np.ndarray] | None = None) -> None:
        """Fill the grammar rows' masks from their states (host work the device step hides). Each
        state first takes the tokens it is missing, in one batched call with the fill: a row one step
        ahead takes its previous token from `previous_tokens()`, the host ids of the stage's previous step."""
        if not self.grammar_rows:
            return
        from pipeline.grammar.state import GrammarState, fill_batch_bitmask, take_tokens

        ahead = any(previous >= 0 for _, _, previous, _ in self.grammar_rows)
        if ahead and previous_tokens is None:
            raise ValueError("a grammar row is one step ahead, but the previous step's tokens are unknown")
        host = previous_tokens().tolist() if ahead else []  # type: ignore[misc]
        accepts = take_tokens([(state, position, host[previous] if previous >= 0 else None)
                               for _, state, previous, position in self.grammar_rows if isinstance(state, GrammarState)],
                              keep_last=True)  # given to the matchers with the fill, in one GIL release
        # a state that ended (its previous token was a stop token) drops its row: it allows everything
        states = [(row, state) for row, state, _, _ in self.grammar_rows if not state.ended]
        self.grammar_bitmask = fill_batch_bitmask(states, self.num_rows, self.vocab_size, self.device, self.staging,
                                                  accepts)

    @property
    def all_greedy(self) -> bool:
        return self.num_random == 0

    @property
    def any_top_k(self) -> bool:
        return self.top_k_max > 0

    @property
    def any_penalties(self) -> bool:
        return self.seen_mask is not None or self.output_counts is not None

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device,
                  staging: HostStaging | None = None) -> SamplingBatch:
        """One pass over the rows on the host, then one small host->device copy per tensor.

        With a runner's `staging` (its own thread only), the host buffers are reused: on CPU the
        batch is valid until that runner's next step."""
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
                seen_rows.append((i, _counts_of(row)))
            if p.presence_penalty or p.frequency_penalty:
                presence[i], frequency[i] = float(p.presence_penalty), float(p.frequency_penalty)
                counted_rows.append((i, _counts_of(row)))
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
                grammar_rows.append((i, row.grammar, row.grammar_previous_row, row.counter))
            if row.forced_token is not None and 0 <= row.forced_token < vocab:
                forced.append((i, row.forced_token))

        seen_flat, counted_flat, counted_values = _penalties.penalty_inputs(seen_rows, counted_rows, vocab)
        upload = _Upload(device, staging)
        upload.f32(temperature=temperature, top_p=top_p, top_p_all=top_p_all, min_p=min_p, repetition_penalty=rep,
                   presence_penalty=presence, frequency_penalty=frequency, bias_values=[b[2] for b in bias])
        upload.i64(top_k_all=top_k_all, random_rows=random_rows, rng_keys=[half for key in rng_keys for half in key], top_k=top_k,
                   top_k_rows=top_k_rows, top_p_rows=top_p_rows,
                   bias_index=[b[j] for j in range(2) for b in bias],
                   suppress_index=[s[j] for j in range(2) for s in suppress],
                   forced_index=[f[j] for j in range(2) for f in forced],
                   seen_ids=seen_flat, counted_ids=counted_flat)
        upload.f32(counted_values=counted_values)
        on_device = upload.send()

        def subset(name: str, indices: list[int]) -> Tensor | None:
            return None if len(indices) == num_rows else on_device[name]

        any_top_p = bool(top_p_rows)
        return cls(
            num_rows=num_rows,
            vocab_size=vocab,
            device=torch.device(device),
            temperature=on_device["temperature"],
            any_temperature=any(t != 1.0 for t in temperature),
            random_rows=on_device["random_rows"],
            rng_keys=upload.shaped(on_device["rng_keys"], (len(rng_keys), 2)),
            num_random=len(random_rows),
            top_k=on_device["top_k"],
            top_k_rows=subset("top_k_rows", top_k_rows),
            top_k_max=max(top_k, default=0),
            top_p=on_device["top_p"],
            top_p_rows=subset("top_p_rows", top_p_rows),
            any_top_p=any_top_p,
            top_p_sort_k=max(top_p_sort_k) if any_top_p and min(top_p_sort_k) > 0 else 0,
            top_k_all=on_device["top_k_all"],
            top_p_all=on_device["top_p_all"],
            min_p=on_device["min_p"],
            any_min_p=any(min_p),
            repetition_penalty=on_device["repetition_penalty"],
            presence_penalty=on_device["presence_penalty"],
            frequency_penalty=on_device["frequency_penalty"],
            seen_mask=_scatter(on_device["seen_ids"], None, num_rows, vocab) > 0 if seen_rows else None,
            output_counts=_scatter(on_device["counted_ids"], on_device["counted_values"], num_rows, vocab)
            if counted_rows else None,
            bias_index=upload.shaped(on_device["bias_index"], (2, len(bias))) if bias else None,
            bias_values=on_device["bias_values"] if bias else None,
            suppress_index=upload.shaped(on_device["suppress_index"], (2, len(suppress))) if suppress else None,
            num_logprobs=num_logprobs,
            max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
            grammar_rows=grammar_rows,
            forced_index=upload.shaped(on_device["forced_index"], (2, len(forced))) if forced else None,
            staging=staging,
        )


class _Upload:
    """A step's small host arrays, sent as one float32 and one int64 buffer: one non-blocking copy
    each (from pinned memory on CUDA), then named views of the device buffers.

    A pageable `torch.tensor(..., device="cuda")` would block the host until the stream drains,
    which defeats launching a step while the previous one still runs. On CPU with a runner's
    staging the buffers are the staging's, reused step after step, with views it made before: no
    torch call (each would hand the GIL to the event loop; see host_staging.py).
    """

    def __init__(self, device: torch.device | str, staging: HostStaging | None = None) -> None:
        self.device = torch.device(device)
        self.staging = staging if self.device.type == "cpu" else None
        self._parts: dict[type, dict[str, np.ndarray]] = {np.float32: {}, np.int64: {}}

    def f32(self, **arrays: Sequence[float] | np.ndarray) -> None:
        self._parts[np.float32].update({k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()})

    def i64(self, **arrays: Sequence[int] | np.ndarray) -> None:
        self._parts[np.int64].update({k: np.asarray(v, dtype=np.int64) for k, v in arrays.items()})

    def send(self) -> dict[str, Tensor]:
        views: dict[str, Tensor] = {}
        for dtype, arrays in self._parts.items():
            if self.staging is not None:
                views.update(self.staging.stage("sampling", arrays, dtype))
                continue
            buffer = torch.from_numpy(np.concatenate(list(arrays.values())))
            if self.device.type != "cpu":
                buffer = (buffer.pin_memory() if self.device.type == "cuda" else buffer).to(self.device, non_blocking=True)
            # one call for every view (a Python slice per array cost ~1 us each, 21 arrays a step)
            views.update(zip(arrays, torch.split_with_sizes(buffer, [len(values) for values in arrays.values()])))
        return views

    def shaped(self, view: Tensor, shape: tuple[int, int]) -> Tensor:
        """An int64 view from `send` in a 2-D shape (cached with a staging)."""
        if self.staging is not None:
            return self.staging.reshaped("sampling", np.int64, view, shape)
        return view.view(shape)


def _counts_of(row: SamplingRow) -> Any:
    """The row's TokenCounts; rows built from plain token lists (tests, tools) get one on the fly."""
    if row.counts is not None:
        return row.counts
    counts = _penalties.TokenCounts(row.prompt_token_ids)
    counts.add_all(row.output_token_ids)
    return counts


def _scatter(flat_ids: Tensor, values: Tensor | None, num_rows: int, vocab_size: int) -> Tensor:
    """[S, V] float32: `values` (or 1) at the flat row * V + token indices, 0 elsewhere."""
    dense = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=flat_ids.device)
    dense[flat_ids] = 1.0 if values is None else values
    return dense.view(num_rows, vocab_size)
