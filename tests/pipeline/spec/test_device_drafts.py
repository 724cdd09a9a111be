"""Drafts left on the device: their host copy, and the one flat view every fed row of a step indexes."""
from __future__ import annotations

import pytest
import torch

from pipeline.spec.device_drafts import DeviceDrafts


def test_values_are_the_rows_and_flat_is_one_view() -> None:
    picks = torch.tensor([[5, 6, 7], [8, 9, 10]])
    drafts = DeviceDrafts.of(picks)
    assert drafts.width == 3 and drafts.values() == [[5, 6, 7], [8, 9, 10]]
    assert drafts.flat is drafts.flat and drafts.flat.tolist() == [5, 6, 7, 8, 9, 10]


def test_a_column_slice_is_made_contiguous() -> None:
    """DFlash's drafts are a block's positions after its first: a strided slice of the picks."""
    picks = torch.arange(8).view(2, 4)[:, 1:]
    drafts = DeviceDrafts.of(picks)
    assert drafts.values() == [[1, 2, 3], [5, 6, 7]] and drafts.flat.tolist() == [1, 2, 3, 5, 6, 7]


@pytest.mark.gpu
def test_gpu_the_host_copy_is_queued_behind_the_drafts() -> None:
    """The copy is queued after the picks are written, without a wait; the values arrive once it is done."""
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big / 64  # keep the stream busy
    picks = big[:2, :3].argmax(dim=1, keepdim=True).expand(2, 3).to(torch.int64)
    drafts = DeviceDrafts.of(picks)
    assert drafts.host.is_pinned() and drafts.values() == picks.cpu().tolist()


def test_promised_drafts_give_ids_only_once_filled() -> None:
    drafts = DeviceDrafts.pending(2)
    with pytest.raises(RuntimeError, match="never drafted"):
        drafts.ids()
    drafts.fill(torch.tensor([[3, 4], [5, 6]]))
    assert drafts.ids() is drafts.flat and drafts.ids().tolist() == [3, 4, 5, 6]
    assert drafts.values() == [[3, 4], [5, 6]]


def test_a_promise_of_another_width_is_refused() -> None:
    with pytest.raises(ValueError, match="width of 3"):
        DeviceDrafts.pending(3).fill(torch.tensor([[3, 4]]))


def test_a_failed_drafter_fails_whatever_reads_its_drafts() -> None:
    drafts = DeviceDrafts.pending(2)
    drafts.fail(ValueError("out of graphs"))
    for read in (drafts.ids, drafts.values):
        with pytest.raises(RuntimeError, match="drafter failed") as info:
            read()
        assert isinstance(info.value.__cause__, ValueError)
