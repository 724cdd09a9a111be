"""Feeding a step tokens left on the device: every pattern of targets and sources writes what a scatter writes,
and the verify rows' pattern (rows of consecutive drafts, a constant step apart) takes one strided copy."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pipeline.runner import token_feed
from pipeline.runner.token_feed import TokenFeed


def scattered(ids: torch.Tensor, targets: list[int], sources: list[int], tokens: torch.Tensor) -> list[int]:
    out = ids.tolist()
    for t, s in zip(targets, sources):
        out[t] = int(tokens[s])
    return out


def verify_rows(rows: int, width: int, row_tokens: int, offset: int) -> tuple[list[int], list[int]]:
    """Each row of ``row_tokens`` inputs takes its ``width`` drafts at ``offset``, from row r's drafts."""
    targets = [r * row_tokens + offset + j for r in range(rows) for j in range(width)]
    return targets, [r * width + j for r in range(rows) for j in range(width)]


@pytest.mark.parametrize("rows,width,row_tokens,offset", [(1, 3, 4, 1), (4, 3, 4, 1), (16, 4, 5, 1), (3, 2, 6, 3)])
def test_verify_rows_take_one_strided_copy_equal_to_a_scatter(rows, width, row_tokens, offset, monkeypatch):
    targets, sources = verify_rows(rows, width, row_tokens, offset)
    tokens = torch.arange(1000, 1000 + rows * width)
    ids = torch.zeros(rows * row_tokens, dtype=torch.int64)
    expected = scattered(ids, targets, sources, tokens)
    assert token_feed._grid(np.asarray(targets), np.asarray(sources)) is not None
    monkeypatch.setattr(torch.Tensor, "index_copy_", None)  # the scatter path would fail
    TokenFeed(np.asarray(targets), np.asarray(sources), tokens).apply(ids)
    assert ids.tolist() == expected


def test_any_pattern_writes_what_a_scatter_writes():
    rng = random.Random(3)
    for _ in range(300):
        size, count = rng.randrange(1, 24), rng.randrange(1, 12)
        n = rng.randrange(1, min(size, count) + 1)
        if rng.random() < 0.5:  # a grid-like pattern, sometimes broken
            rows, width = rng.randrange(1, 4), rng.randrange(1, 4)
            step = width + rng.randrange(0, 3)
            targets = [r * step + j for r in range(rows) for j in range(width)]
            sources = [r * width + j for r in range(rows) for j in range(width)]
            if rng.random() < 0.3 and len(targets) > 1:
                i = rng.randrange(len(sources))
                sources[i] = (sources[i] + 1) % len(sources)
            size, count = max(size, max(targets) + 1), max(count, max(sources) + 1)
        else:
            targets = rng.sample(range(size), n)
            sources = [rng.randrange(count) for _ in range(n)]
        tokens = torch.arange(500, 500 + count)
        ids = torch.full((size,), -1, dtype=torch.int64)
        expected = scattered(ids, targets, sources, tokens)
        TokenFeed(np.asarray(targets), np.asarray(sources), tokens).apply(ids)
        assert ids.tolist() == expected, (targets, sources)


def test_views_with_an_offset_are_fed_at_their_own_positions():
    base = torch.zeros(12, dtype=torch.int64)
    ids = base[4:10]  # a view: storage offset 4
    drafts = torch.arange(100, 110)[2:8]
    targets, sources = verify_rows(2, 2, 3, 1)
    TokenFeed(np.asarray(targets), np.asarray(sources), drafts).apply(ids)
    assert base.tolist() == [0] * 4 + [0, 102, 103, 0, 104, 105] + [0, 0]
