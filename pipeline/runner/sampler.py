"""The sampler: logits [S, V] -> one token per row, plus logprobs, with one device->host copy.

Every path that picks a token calls `Sampler`, and the sampler runs the single logits pipeline
(`apply_logits_pipeline`) before choosing; there is no other route to a token (docs/architecture.md, invariant 3).

Randomness is stateless. A random row's noise is a counter-based hash of (its rng_key, vocab
index): rng_key mixes only (seed, counter), so a row draws the same token alone or in any batch,
at any position. The hash is exact integer math, so CPU and CUDA should agree (not yet checked on
a GPU), and no generator state is kept. The draw is the Gumbel-max trick (argmax of logits +
Gumbel noise), equal in law to sampling softmax(logits); masked (-inf) tokens never win. Greedy
rows use no noise.

Logprobs are those of the model's raw distribution: log_softmax of the logits as given, before
penalties, bias, temperature or filters (vLLM's default "raw_logprobs").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels import dispatch
from kernels.triton_greedy import GreedyPicker
from pipeline.request import TokenLogprob
from pipeline.runner.host_staging import queue_host_copy
from pipeline.runner.logits_pipeline import apply_logits_pipeline
from pipeline.runner.sampling_batch import SamplingBatch

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x, c < 2**32 in int64 without overflow (split x into 16-bit halves)."""
    low = (x & 0xFFFF) * c
    high = (((x >> 16) * c) & 0xFFFF) << 16
    return (low + high) & _M32


def _lowbias32(x: Tensor) -> Tensor:
    """A 32-bit integer finalizer with low bias (C. Wellons' lowbias32), on int64 lanes."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(rng_keys: Tensor, vocab_size: int) -> Tensor:
    """Gumbel(0, 1) noise [R, V] float32, a pure function of each row's key and the vocab index.

    Drawn as -log(E), E = -log1p(-w) ~ Exponential(1), w uniform in (0, 1): small w (the large,
    decisive noise values) keeps full float32 precision. Always finite.
    """
    index = _mul32(torch.arange(vocab_size, device=rng_keys.device, dtype=torch.int64), 0x9E3779B9)
    bits = _lowbias32(_lowbias32((index[None, :] + rng_keys[:, :1]) & _M32) ^ rng_keys[:, 1:])
    uniform = ((bits.to(torch.float32) + 0.5) * 2.0**-32).clamp_(max=1.0 - 2.0**-24)
    return torch.log1p(-uniform).neg_().log_().neg_()


@dataclass(slots=True)
class SamplerOutput:
    """Host results of one step. Rows that asked for fewer alternatives than K read a prefix."""

    token_ids: np.ndarray  # int64 [S]
    logprobs: np.ndarray | None  # float32 [S]: raw logprob of the chosen token; None when no row asked
    top_ids: np.ndarray | None  # int64 [S, K], K = max requested, best first; None when K == 0
    top_logprobs: np.ndarray | None  # float32 [S, K]
    num_logprobs: np.ndarray | None = None  # int64 [S]: alternatives each row asked for, -1 = none

    def token_logprob(self, row: int) -> TokenLogprob | None:
        """The row's TokenLogprob (its own number of alternatives), or None when it asked for none."""
        if self.logprobs is None or self.num_logprobs is None or self.num_logprobs[row] < 0:
            return None
        k = int(self.num_logprobs[row])
        top: list[tuple[int, float]] = []
        if k and self.top_ids is not None and self.top_logprobs is not None:
            top = list(zip(self.top_ids[row, :k].tolist(), self.top_logprobs[row, :k].tolist()))
        return TokenLogprob(int(self.token_ids[row]), float(self.logprobs[row]), top)


class DeviceSample:
    """A step's results, still on the device. Creating it starts the step's single device->host
    copy (into pinned memory, behind the step's kernels); `to_host()` waits for that copy alone.
    Meanwhile `token_ids` can feed the next step's launch (one step ahead)."""

    __slots__ = ("token_ids", "_host", "_ready", "num_top", "num_logprobs", "has_logprobs", "_output")

    def __init__(self, token_ids: Tensor, packed: Tensor, num_top: int, num_logprobs: np.ndarray,
                 has_logprobs: bool) -> None:
        self.token_ids = token_ids  # int64 [S], on the device
        # packed: float64 [S, 1 (+1 +2K)]: token, chosen logprob, top ids, top logprobs (exact in f64)
        self._host, self._ready = queue_host_copy(packed)
        self.num_top = num_top  # K
        self.num_logprobs = num_logprobs
        self.has_logprobs = has_logprobs
        self._output: SamplerOutput | None = None

    def is_ready(self) -> bool:
        """True when `to_host()` would not wait for the device."""
        return self._output is not None or self._ready is None or self._ready.query()

    def to_host(self) -> SamplerOutput:
        """Wait for the step's copy and unpack it (once; later calls return the same output)."""
        if self._output is not None:
            return self._output
        if self._ready is not None:
            self._ready.synchronize()
        host = self._host.numpy()
        token_ids = host[:, 0].astype(np.int64)
        if not self.has_logprobs:
            self._output = SamplerOutput(token_ids, None, None, None, self.num_logprobs)
            return self._output
        k = self.num_top
        top_ids = host[:, 2 : 2 + k].astype(np.int64) if k else None
        top_logprobs = host[:, 2 + k : 2 + 2 * k].astype(np.float32) if k else None
        self._output = SamplerOutput(token_ids, host[:, 1].astype(np.float32), top_ids, top_logprobs,
                                     self.num_logprobs)
        return self._output


def pick_tokens(processed: Tensor, batch: SamplingBatch) -> Tensor:
    """Greedy rows: argmax (first index on ties). Random rows: argmax of logits + Gumbel noise."""
    if batch.all_greedy:
        return processed.argmax(dim=-1)
    if batch.num_random == batch.num_rows:
        return (processed + gumbel_noise(batch.rng_keys, batch.vocab_size)).argmax(dim=-1)
    token_ids = processed.argmax(dim=-1)
    rows = batch.random_rows
    noisy = processed[rows] + gumbel_noise(batch.rng_keys, batch.vocab_size)
    token_ids[rows] = noisy.argmax(dim=-1)
    return token_ids


class Sampler:
    """Picks one token per row through the logits pipeline; the only way tokens are chosen."""

    def __init__(self) -> None:
        self._greedy = GreedyPicker()  # argmax on the GPU in two kernels (kernels/triton_greedy.py)

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sample(logits, batch).to_host()

    def sample(self, logits: Tensor, batch: SamplingBatch) -> DeviceSample:
        """Everything on the device, no host sync; `to_host()` on the result copies once."""
        raw = logits.float()
        processed = apply_logits_pipeline(raw, batch)
        if batch.all_greedy and batch.max_num_logprobs is None and dispatch.use_triton(processed.device):
            token_ids, packed = self._greedy(processed)  # the tokens and their float64 column, no other op
            return DeviceSample(token_ids=token_ids, packed=packed, num_top=0, num_logprobs=batch.num_logprobs,
                                has_logprobs=False)
        token_ids = pick_tokens(processed, batch)
        columns = [token_ids[:, None].double()]
        num_top = 0
        if batch.max_num_logprobs is not None:
            raw_logprobs = raw.log_softmax(dim=-1)
            columns.append(raw_logprobs.gather(1, token_ids[:, None]).double())
            num_top = min(batch.max_num_logprobs, batch.vocab_size)
            if num_top:
                top_logprobs, top_ids = raw_logprobs.topk(num_top, dim=-1)
                columns += [top_ids.double(), top_logprobs.double()]
        return DeviceSample(
            token_ids=token_ids,
            packed=torch.cat(columns, dim=1) if len(columns) > 1 else columns[0],  # (one column: no copy)
            num_top=num_top,
            num_logprobs=batch.num_logprobs,
            has_logprobs=batch.max_num_logprobs is not None,
        )
