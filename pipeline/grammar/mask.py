"""A step's grammar mask: the token bitmasks of the rows a grammar constrains, filled on the host while the
forward runs and sent to the device in one copy.

The bitmask holds one row per constrained sampling row (plain rows, then the speculative rows after drafts), not one
per batch row: a batch of 256 rows with one grammar sends one row of ceil(V/32) words. xgrammar fills it in place,
in the runner's host buffer (on a GPU a pinned one, so its copy needs no staging copy first), in one batched call
that also gives the matchers the tokens they are missing (ext/grammar_step), spread over xgrammar's threads for
larger batches. A row that allows every token (a tool grammar before its trigger, free text) is then dropped: it
costs the device nothing: it is not sent, not masked, and when no row of the step refuses a token the logits are not
even copied. The rows that remain move to the front, and the index of the batch rows they mask travels in the same
copy: `rows[i]` is the batch row that bitmask row `slots[i]` masks (the logits pipeline's one masked apply:
kernels/triton_bitmask.py on the GPU, ext/bitmask on the CPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import ext
from pipeline.grammar.state import GrammarState, TokenRound, batch_matcher
from pipeline.runner.host_staging import HostStaging

_bitmask = ext.load("bitmask")
_grammar_step = ext.load("grammar_step")

# Below this many rows the matchers fill on the calling thread, keeping the GIL: handing a few rows
# to xgrammar's thread pool and waiting for it, or giving the GIL up for microseconds of work and
# waiting to win it back from the event loop, costs more than their fill (host bench, batch 1).
BATCH_FILL_MIN_ROWS = 8


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(slots=True)
class GrammarMask:
    """What the logits pipeline masks: bitmask row ``slots[i]`` (int32 words, bit j of word w allows token 32w + j)
    refuses tokens of batch row ``rows[i]``; every other row is left as it is. The tensors are on the logits'
    device; the host arrays are their source (valid until the runner's next step)."""

    bitmask: torch.Tensor  # int32 [N, W]
    rows: torch.Tensor  # int32 [K]
    slots: torch.Tensor  # int32 [K]
    host_bitmask: np.ndarray
    host_rows: np.ndarray
    host_slots: np.ndarray

    def allowed(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """bool [num_rows, V] on the host: the tokens each batch row may pick."""
        allowed = torch.ones((num_rows, vocab_size), dtype=torch.bool)
        for row, slot in zip(self.host_rows.tolist(), self.host_slots.tolist()):
            bits = np.unpackbits(self.host_bitmask[slot].view(np.uint8), bitorder="little")[:vocab_size]
            allowed[row] = torch.from_numpy(bits.astype(bool))
        return allowed


def _fill_rows(states: list[tuple[int, GrammarState]], array: np.ndarray, accepts: TokenRound | None) -> None:
    """Bitmask rows 0..len(states)-1 from the states, after their matchers take ``accepts``."""
    if all(isinstance(state, GrammarState) for _, state in states):
        many = len(states) >= BATCH_FILL_MIN_ROWS
        refused = _grammar_step.accept_and_fill(batch_matcher(pooled=many), accepts.matchers if accepts else [],
                                                accepts.tokens if accepts else [],
                                                [state.matcher for _, state in states], array,
                                                list(range(len(states))), many)
        if refused:  # (only a bug lets the mask allow a refused token) those rows allow everything
            assert accepts is not None
            accepts.refuse(refused)
            for slot, (_, state) in enumerate(states):
                if state.refused:
                    array[slot] = -1
        return
    if accepts is not None:  # test doubles: objects with fill(tensor, row)
        accepts.take()
    view = torch.from_numpy(array)
    for slot, (_, state) in enumerate(states):
        state.fill(view, slot)


def fill_draft_rows(array: np.ndarray, draft_slots: list[tuple[int, GrammarState, tuple[int, ...]]]) -> None:
    """Speculative verify rows after drafts, (bitmask row, state, drafts) (their state's row before the drafts is
    filled already, its matcher at that position): each matcher takes the drafts in order, fills the row after each,
    and is rolled back to where it was. Past a draft it refuses, or a stop token, the rows get the last mask it could
    fill, or allow everything: their positions are rejected anyway (the token picked there differs from the draft)."""
    view = torch.from_numpy(array)
    by_state: dict[int, tuple[GrammarState, list[tuple[int, int, tuple[int, ...]]]]] = {}
    for slot, state, drafts in draft_slots:
        by_state.setdefault(id(state), (state, []))[1].append((len(drafts), slot, drafts))
    for state, rows in by_state.values():
        matcher, taken, stuck = state.matcher, 0, state.ended or state.refused
        for count, slot, drafts in sorted(rows):
            if not stuck and taken < count:
                stuck = not matcher.accept_token(drafts[count - 1])
                taken += not stuck
            if state.ended or matcher.is_terminated():
                array[slot] = -1
            else:
                matcher.fill_next_token_bitmask(view, slot)
        if taken:
            matcher.rollback(taken)


def fill_grammar_mask(states: list[tuple[int, GrammarState]], vocab_size: int, device: torch.device,
                      staging: HostStaging | None = None, accepts: TokenRound | None = None,
                      draft_rows: list[tuple[int, GrammarState, tuple[int, ...]]] = ()) -> GrammarMask | None:
    """The step's mask: ``states`` (batch row, state) and ``draft_rows`` (batch row, state, drafts before it) filled,
    the rows that allow everything dropped, the rest on ``device``; None when no row refuses a token. ``accepts``
    (take_tokens' last round, kept) goes to the matchers first, in the same GIL release as the fill.

    With a runner's ``staging`` the host buffer and the device buffer are the staging's, reused step after step (a
    fresh 1.5 MB array per step at batch 256 is a fresh mapping whose every page faults on first write): on the CPU
    the mask is valid until the runner's next step, which samples before that; on CUDA xgrammar writes into a pinned
    buffer whose one copy is queued without blocking, so it never waits behind the step's kernels."""
    count = len(states) + len(draft_rows)
    if count == 0:
        if accepts is not None:  # no row to fill: the accepts alone
            accepts.take()
        return None
    words = bitmask_words(vocab_size)
    size = count * words + 2 * count  # the bitmask, then the rows and slots of the rows that refuse some token
    buffer = staging.host_buffer("grammar_mask", np.int32, size, device) if staging is not None else np.empty(
        size, dtype=np.int32)
    array = buffer[:count * words].reshape(count, words)
    _fill_rows(states, array, accepts)
    if draft_rows:
        fill_draft_rows(array, [(len(states) + i, state, drafts) for i, (_, state, drafts) in enumerate(draft_rows)])
    slots = _bitmask.masking_rows(array, count, vocab_size)
    if not slots:
        return None
    kept = len(slots)
    batch_rows = [row for row, _ in states] + [row for row, _, _ in draft_rows]
    rows_masked = [batch_rows[slot] for slot in slots]
    if kept < count:  # the rows that refuse a token to the front: only they are sent
        array[:kept] = array[slots]
        slots = list(range(kept))
    bitmask_size = kept * words
    index = buffer[bitmask_size:bitmask_size + 2 * kept]
    index[:kept] = rows_masked
    index[kept:] = slots
    shapes = ((kept, words), (kept,), (kept,))
    sent = bitmask_size + 2 * kept
    if staging is not None:
        bitmask, rows, slot_tensor = staging.send("grammar_mask", np.int32, sent, device, shapes)
    else:
        flat = torch.from_numpy(buffer[:sent])
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        elif device.type != "cpu":
            flat = flat.to(device)
        bitmask, rows, slot_tensor = flat[:bitmask_size].view(kept, words), flat[bitmask_size:-kept], flat[-kept:]
    return GrammarMask(bitmask, rows, slot_tensor, array[:kept], index[:kept], index[kept:])
