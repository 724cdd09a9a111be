"""The one logits-processing pipeline (docs/architecture.md, invariant 3).

Every path that picks a token — the first token after prefill, plain decode, each position of a
speculative verify — goes through `Sampler`, which calls `apply_logits_pipeline` exactly once. The
steps run in the order of `LOGITS_STEPS`:

    repetition penalty -> presence/frequency penalties -> logit_bias -> min_tokens
    -> grammar bitmask -> forced tokens -> temperature -> truncation (top-k -> top-p -> min-p)

Edits that change which tokens are allowed or how likely they are (penalties, bias, masks) come
before temperature; truncation filters come last, on the tempered distribution. Each step takes
the batch's private float32 logits [S, V], may edit them in place, returns them, and returns at
once when no row needs it (decided from host-side flags, so skipping never syncs the device).
Filters mask with -inf; greedy rows carry neutral filter values (see sampling_batch).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

import ext
from kernels import dispatch
from kernels.triton_bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton
from kernels.triton_sampling import apply_cutoff_, topk_topp_minp_cutoff_triton
from pipeline.runner.sampling_batch import SamplingBatch

_bitmask = ext.load("bitmask")

Step = Callable[[Tensor, SamplingBatch], Tensor]
NEG_INF = float("-inf")
CUTOFF_KERNEL_MIN_ROWS = 32  # below this a sort of k_max values (or of the row) is faster on an H100


def _on_rows(logits: Tensor, rows: Tensor | None, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Apply a per-row function to the selected rows only (rows=None: all rows, no gather)."""
    if rows is None:
        return fn(logits)
    logits[rows] = fn(logits[rows])
    return logits


def apply_repetition_penalty(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """HF semantics over prompt + output tokens: positive logits divided, negative multiplied."""
    if batch.seen_mask is None:
        return logits
    penalty = batch.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(batch.seen_mask, penalized, logits)


def apply_presence_frequency_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """OpenAI semantics over output tokens only: minus frequency * count, minus presence if count > 0."""
    counts = batch.output_counts
    if counts is None:
        return logits
    logits -= batch.frequency_penalty[:, None] * counts
    logits -= batch.presence_penalty[:, None] * (counts > 0)
    return logits


def apply_logit_bias(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Add each request's logit_bias (sparse: one index_put over all rows)."""
    if batch.bias_index is None:
        return logits
    rows, cols = batch.bias_index
    return logits.index_put_((rows, cols), batch.bias_values, accumulate=True)


def apply_min_tokens(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Forbid eos and stop_token_ids while a row has fewer than min_tokens outputs."""
    if batch.suppress_index is None:
        return logits
    rows, cols = batch.suppress_index
    return logits.index_put_((rows, cols), torch.full((), NEG_INF, device=logits.device))


def apply_grammar_bitmask(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Forbid every token a row's grammar does not allow next: one kernel for the constrained rows on the GPU, one
    compiled pass over their bitmask words on the CPU (ext/bitmask); the other rows are not touched."""
    mask = batch.grammar_mask
    if mask is None:
        return logits
    if dispatch.use_triton(logits.device):
        return apply_token_bitmask_triton(logits, mask.bitmask, mask.rows, mask.slots)
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        _bitmask.apply_bitmask(logits.numpy(), mask.host_bitmask, mask.host_rows, mask.host_slots)
        return logits
    return apply_token_bitmask_ref(logits, mask.bitmask, mask.rows, mask.slots)


def apply_forced_tokens(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Rows with a forced token can pick nothing else."""
    if batch.forced_index is None:
        return logits
    rows, cols = batch.forced_index
    kept = logits[rows, cols]
    logits[rows] = NEG_INF
    logits[rows, cols] = torch.where(torch.isfinite(kept), kept, torch.zeros_like(kept))
    return logits


def apply_temperature(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Divide by the row's temperature (1.0 for greedy and neutral rows)."""
    if not batch.any_temperature:
        return logits
    return logits.div_(batch.temperature[:, None])


def apply_top_k(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Keep the tokens whose logit is >= the row's k-th largest (ties at the k-th value stay, as in
    vLLM); at most k_max values are selected, never the whole vocabulary sorted."""
    if not batch.any_top_k:
        return logits
    k_max = batch.top_k_max

    def keep_top_k(rows: Tensor) -> Tensor:
        values = rows.topk(k_max, dim=-1).values
        kth = values.gather(1, (batch.top_k[:, None] - 1).clamp_(max=k_max - 1))
        return rows.masked_fill(rows < kth, NEG_INF)

    return _on_rows(logits, batch.top_k_rows, keep_top_k)


def apply_top_p(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Keep the smallest prefix (by probability) whose mass reaches p; the top token always stays.

    Tokens tied with the last kept one stay too. When every top-p row also has top-k, only the
    k_max best values are sorted instead of the whole vocabulary.
    """
    if not batch.any_top_p:
        return logits

    def keep_top_p(rows: Tensor) -> Tensor:
        if batch.top_p_sort_k:
            ranked = rows.topk(batch.top_p_sort_k, dim=-1).values
        else:
            ranked = rows.sort(dim=-1, descending=True).values
        cumulative = ranked.softmax(dim=-1).cumsum(dim=-1)
        # tokens before the one where the mass first reaches p, plus that one
        num_kept = (cumulative < batch.top_p[:, None]).sum(dim=-1, keepdim=True) + 1
        cutoff = ranked.gather(1, num_kept.clamp_(max=ranked.shape[-1]) - 1)
        return rows.masked_fill(rows < cutoff, NEG_INF)

    return _on_rows(logits, batch.top_p_rows, keep_top_p)


def apply_truncation(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """top-k, then top-p on its survivors, then min-p: each keeps {x >= threshold}. Large batches on the
    GPU find the three thresholds at once without sorting (kernels/triton_sampling.py, ~6x faster than
    sorting at 256 rows of a 152k vocabulary); small ones sort only top-k's k_max values, or the row."""
    if not (batch.any_top_k or batch.any_top_p or batch.any_min_p):
        return logits
    if batch.num_rows >= CUTOFF_KERNEL_MIN_ROWS and dispatch.use_triton(logits.device):
        cutoff = topk_topp_minp_cutoff_triton(logits, batch.top_k_all, batch.top_p_all, batch.min_p)
        return apply_cutoff_(logits, cutoff)
    return apply_min_p(apply_top_p(apply_top_k(logits, batch), batch), batch)


def apply_min_p(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    if not batch.any_min_p:
        return logits
    threshold = logits.amax(dim=-1, keepdim=True) + batch.min_p.log()[:, None]  # log 0 = -inf: off
    return logits.masked_fill_(logits < threshold, NEG_INF)


# The order is the contract. New steps are one line here.
LOGITS_STEPS: list[tuple[str, Step]] = [
    ("repetition_penalty", apply_repetition_penalty),
    ("presence_frequency_penalties", apply_presence_frequency_penalties),
    ("logit_bias", apply_logit_bias),
    ("min_tokens", apply_min_tokens),
    # After every additive edit, before temperature and truncation, so a filter never renormalizes
    # over tokens the grammar forbids.
    ("grammar_bitmask", apply_grammar_bitmask),
    ("forced_tokens", apply_forced_tokens),
    ("temperature", apply_temperature),
    ("truncation", apply_truncation),  # top-k -> top-p -> min-p
]


def changes_logits(batch: SamplingBatch) -> bool:
    """Whether any step of ``LOGITS_STEPS`` acts on this batch: each step's own guard, all in one place."""
    return (batch.seen_mask is not None or batch.output_counts is not None or batch.bias_index is not None
            or batch.suppress_index is not None or batch.grammar_mask is not None
            or batch.forced_index is not None or batch.any_temperature
            or batch.any_top_k or batch.any_top_p or batch.any_min_p)


def apply_logits_pipeline(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Run every step in order on a private float32 copy; the caller's logits stay raw. A batch no step acts on
    (greedy rows with nothing else asked) gets the float32 logits themselves: nothing writes them, and the copy
    was a device op between two decode steps."""
    if tuple(logits.shape) != (batch.num_rows, batch.vocab_size):
        raise ValueError(f"logits {tuple(logits.shape)} do not match the batch ({batch.num_rows}, {batch.vocab_size})")
    if not changes_logits(batch):
        return logits.to(torch.float32)
    processed = logits.to(torch.float32, copy=True)
    for _name, step in LOGITS_STEPS:
        processed = step(processed, batch)
    return processed
