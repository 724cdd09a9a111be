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
from pipeline.runner import sampling_rows as _sampling_rows
from pipeline.runner.host_staging import HostStaging
from pipeline.runner.sampling_rows import GREEDY_EPS as GREEDY_EPS  # re-exported
from pipeline.runner.sampling_rows import rng_key as rng_key

_penalties = ext.load("penalties")


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
    # a speculative verify row after drafts: the drafts before its position, which the grammar's matcher takes
    # before it fills the row's mask (and gives back after)
    grammar_drafts: tuple[int, ...] = ()


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
    # grammar rows (host states) and their mask (pipeline/grammar/mask.py: the bitmasks of the rows that refuse
    # some token, None when none does), set by the runner after the forward is launched (fill_grammar_bitmask);
    # forced tokens as indices [2, F]
    # (row, state, previous row, output position being picked)
    grammar_rows: list[tuple[int, Any, int, int]] = field(default_factory=list)
    grammar_draft_rows: list[tuple[int, Any, tuple[int, ...]]] = field(default_factory=list)  # (row, state, drafts)
    grammar_mask: Any = None  # GrammarMask
    forced_index: Tensor | None = None
    staging: HostStaging | None = None  # the runner's reused host buffers (the bitmask's too)

    def fill_grammar_bitmask(self, previous_tokens: Callable[[], np.ndarray] | None = None) -> None:
        """Fill the grammar rows' masks from their states (host work the device step hides). Each
        state first takes the tokens it is missing, in one batched call with the fill: a row one step
        ahead takes its previous token from `previous_tokens()`, the host ids of the stage's previous step."""
        if not self.grammar_rows and not self.grammar_draft_rows:
            return
        from pipeline.grammar.mask import fill_grammar_mask
        from pipeline.grammar.state import plan_rows

        ahead = any(previous >= 0 for _, _, previous, _ in self.grammar_rows)
        if ahead and previous_tokens is None:
            raise ValueError("a grammar row is one step ahead, but the previous step's tokens are unknown")
        host = previous_tokens().tolist() if ahead else []  # type: ignore[misc]
        # the accepts go to the matchers with the fill, in one GIL release
        accepts, states = plan_rows(self.grammar_rows, host)
        self.grammar_mask = fill_grammar_mask(states, self.vocab_size, self.device, self.staging, accepts,
                                              self.grammar_draft_rows)

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
        r = _sampling_rows.gather(rows, vocab, _counts_of)  # pipeline/runner/sampling_rows.py says what it reads
        seen_flat, counted_flat, counted_values = _penalties.penalty_inputs(r.seen_rows, r.counted_rows, vocab)
        upload = _Upload(device, staging)
        upload.f32(temperature=r.temperature, top_p=r.top_p, top_p_all=r.top_p_all, min_p=r.min_p,
                   repetition_penalty=r.repetition_penalty, presence_penalty=r.presence_penalty,
                   frequency_penalty=r.frequency_penalty, bias_values=r.bias_values)
        upload.i64(top_k_all=r.top_k_all, random_rows=r.random_rows, rng_keys=r.rng_keys, top_k=r.top_k,
                   top_k_rows=r.top_k_rows, top_p_rows=r.top_p_rows, bias_index=r.bias_index,
                   suppress_index=r.suppress_index, forced_index=r.forced_index,
                   seen_ids=seen_flat, counted_ids=counted_flat)
        upload.f32(counted_values=counted_values)
        on_device = upload.send()

        def subset(name: str, indices: np.ndarray) -> Tensor | None:
            return None if len(indices) == num_rows else on_device[name]

        num_random, num_bias = len(r.random_rows), len(r.bias_values)
        num_suppress, num_forced = len(r.suppress_index) // 2, len(r.forced_index) // 2
        return cls(
            num_rows=num_rows,
            vocab_size=vocab,
            device=torch.device(device),
            temperature=on_device["temperature"],
            any_temperature=r.any_temperature,
            random_rows=on_device["random_rows"],
            rng_keys=upload.shaped(on_device["rng_keys"], (num_random, 2)),
            num_random=num_random,
            top_k=on_device["top_k"],
            top_k_rows=subset("top_k_rows", r.top_k_rows),
            top_k_max=r.top_k_max,
            top_p=on_device["top_p"],
            top_p_rows=subset("top_p_rows", r.top_p_rows),
            any_top_p=len(r.top_p_rows) > 0,
            top_p_sort_k=r.top_p_sort_k,
            top_k_all=on_device["top_k_all"],
            top_p_all=on_device["top_p_all"],
            min_p=on_device["min_p"],
            any_min_p=r.any_min_p,
            repetition_penalty=on_device["repetition_penalty"],
            presence_penalty=on_device["presence_penalty"],
            frequency_penalty=on_device["frequency_penalty"],
            seen_mask=_scatter(on_device["seen_ids"], None, num_rows, vocab) > 0 if r.seen_rows else None,
            output_counts=_scatter(on_device["counted_ids"], on_device["counted_values"], num_rows, vocab)
            if r.counted_rows else None,
            bias_index=upload.shaped(on_device["bias_index"], (2, num_bias)) if num_bias else None,
            bias_values=on_device["bias_values"] if num_bias else None,
            suppress_index=upload.shaped(on_device["suppress_index"], (2, num_suppress)) if num_suppress else None,
            num_logprobs=r.num_logprobs,
            max_num_logprobs=r.max_num_logprobs,
            grammar_rows=r.grammar_rows,
            grammar_draft_rows=r.grammar_draft_rows,
            forced_index=upload.shaped(on_device["forced_index"], (2, num_forced)) if num_forced else None,
            staging=staging,
        )


class _Upload:
    """A step's small host arrays, sent as one float32 and one int64 buffer: one non-blocking copy
    each (from pinned memory on CUDA), then named views of the device buffers.

    A pageable `torch.tensor(..., device="cuda")` would block the host until the stream drains,
    which defeats launching a step while the previous one still runs. With a runner's staging the
    buffers are the staging's, reused step after step, with views it made before: on CPU no torch
    call (each would hand the GIL to the event loop), on CUDA one copy and one event record a dtype
    (host_staging.py).
    """

    def __init__(self, device: torch.device | str, staging: HostStaging | None = None) -> None:
        self.device = torch.device(device)
        self.staging = staging if self.device.type in ("cpu", "cuda") else None
        self._parts: dict[type, dict[str, np.ndarray]] = {np.float32: {}, np.int64: {}}

    def f32(self, **arrays: Sequence[float] | np.ndarray) -> None:
        self._parts[np.float32].update({k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()})

    def i64(self, **arrays: Sequence[int] | np.ndarray) -> None:
        self._parts[np.int64].update({k: np.asarray(v, dtype=np.int64) for k, v in arrays.items()})

    def send(self) -> dict[str, Tensor]:
        views: dict[str, Tensor] = {}
        for dtype, arrays in self._parts.items():
            if self.staging is not None:
                views.update(self.staging.stage("sampling", arrays, dtype) if self.device.type == "cpu"
                             else self.staging.upload("sampling", arrays, dtype, self.device))
                continue
            buffer = torch.from_numpy(np.concatenate(list(arrays.values())))
            if self.device.type != "cpu":
                staged = buffer.pin_memory() if self.device.type == "cuda" else buffer
                buffer = staged.to(self.device, non_blocking=True)
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
