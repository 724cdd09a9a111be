"""The greedy pick (kernels/triton_greedy.py) against torch's argmax: ties to the first column, -0 equal to +0,
masked (-inf) columns, rows that are all -inf, several chunks a row, and keys reset between calls. On CPU the
kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.triton_greedy import BLOCK, GreedyPicker, greedy_pick_ref

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs triton (GPU or TRITON_INTERPRET=1)")


def logits_with_cases(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    x[0, 5] = x[0, vocab - 3] = x[0].max() + 1.0  # a tie across chunks: the first wins
    x[1] = float("-inf")  # every column masked: column 0, as torch
    x[2] = 0.0
    x[2, 7] = -0.0  # -0 equals +0: the first zero (column 0) wins
    x[3, : vocab // 2] = float("-inf")  # a row whose best sits in a later chunk
    x[4] = -5.0
    x[4, vocab - 1] = -4.0  # the last column, in a ragged last chunk
    return x.to(DEVICE)


@pytest.mark.parametrize("vocab", [17, BLOCK, BLOCK + 5, 3 * BLOCK - 1])
def test_greedy_pick_matches_argmax(vocab):
    logits = logits_with_cases(6, vocab)
    picker = GreedyPicker()
    for _ in range(2):  # the second call starts from the keys the first reset
        ids, packed = picker(logits)
        ref_ids, ref_packed = greedy_pick_ref(logits)
        assert torch.equal(ids, ref_ids) and torch.equal(packed, ref_packed)
        assert ids.dtype == torch.int64 and packed.shape == (6, 1) and packed.dtype == torch.float64
    assert int(ids[0]) == 5 and int(ids[1]) == 0 and int(ids[2]) == 0 and int(ids[4]) == vocab - 1


def test_greedy_pick_grows_and_shrinks_batches():
    picker = GreedyPicker()
    for rows, seed in ((3, 1), (70, 2), (5, 3)):  # 70 rows: keys grow past the first 64
        logits = torch.randn(rows, BLOCK + 9, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        assert torch.equal(picker(logits)[0], logits.argmax(-1))
    strided = torch.randn(4, 2 * (BLOCK + 9), generator=torch.Generator().manual_seed(4)).to(DEVICE)[:, ::2]
    assert torch.equal(picker(strided)[0], strided.argmax(-1))
