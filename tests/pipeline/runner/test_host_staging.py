"""The runner's reused host buffers: staged views hold the step's values, are made once per shape
(no torch call in steady state), and batches built through them equal freshly built ones."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.runner import host_staging
from pipeline.runner.host_staging import HostStaging
from pipeline.runner.sampler import Sampler
from pipeline.runner.sampling_batch import SamplingBatch
from tests.pipeline.runner.test_logits_pipeline import V, make_logits, make_rows

CPU = torch.device("cpu")


def test_staged_views_hold_each_steps_values_and_are_made_once():
    staging = HostStaging()
    first = staging.stage("s", {"a": np.arange(3), "b": np.arange(5) * 10}, np.int64)
    assert first["a"].tolist() == [0, 1, 2] and first["b"].tolist() == [0, 10, 20, 30, 40]
    second = staging.stage("s", {"a": [7, 8, 9], "b": [1, 2, 3, 4, 5]}, np.int64)
    assert second["a"] is first["a"] and second["b"] is first["b"]  # cached: no new tensor
    assert second["a"].tolist() == [7, 8, 9] and second["b"].tolist() == [1, 2, 3, 4, 5]
    pairs = staging.reshaped("s", np.int64, second["a"], (3, 1))
    assert pairs.tolist() == [[7], [8], [9]] and staging.reshaped("s", np.int64, second["a"], (3, 1)) is pairs
    floats = staging.stage("s", {"a": [0.5, 1.5]}, np.float32)  # another dtype: its own buffer
    assert floats["a"].dtype == torch.float32 and floats["a"].tolist() == [0.5, 1.5]
    assert second["a"].tolist() == [7, 8, 9]


def test_a_buffer_grows_when_a_step_needs_more():
    staging = HostStaging()
    staging.stage("s", {"a": np.ones(10)}, np.float32)
    big = staging.stage("s", {"a": np.arange(1000), "b": np.arange(3)}, np.float32)
    assert big["a"].tolist() == list(range(1000)) and big["b"].tolist() == [0, 1, 2]
    array, view = staging.matrix("m", np.int32, 4, 3)
    array[:] = np.arange(12).reshape(4, 3)
    assert view.tolist() == np.arange(12).reshape(4, 3).tolist() and array.flags.c_contiguous


def test_the_view_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(host_staging, "MAX_CACHED_VIEWS", 4)
    staging = HostStaging()
    for n in range(1, 20):
        assert staging.stage("s", {"a": np.arange(n)}, np.int64)["a"].tolist() == list(range(n))
    assert len(staging._buffers[("s", np.dtype(np.int64))].views) <= 4


def _fields(batch: SamplingBatch) -> dict:
    return {name: getattr(batch, name) for name in SamplingBatch.__slots__ if name != "staging"}


@pytest.mark.parametrize("subset", [None, [0, 3, 9, 14], [2, 10, 11, 13]])
def test_batches_built_through_a_staging_equal_fresh_ones(subset):
    rows = make_rows()
    rows = rows if subset is None else [rows[i] for i in subset]
    staging = HostStaging()
    SamplingBatch.from_rows(make_rows(), V, CPU, staging)  # an earlier, bigger step wrote the buffers
    staged = SamplingBatch.from_rows(rows, V, CPU, staging)
    fresh = SamplingBatch.from_rows(rows, V, CPU)
    for name, value in _fields(fresh).items():
        other = getattr(staged, name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), name
        elif isinstance(value, np.ndarray):
            assert np.array_equal(value, other), name
        elif name != "grammar_rows":
            assert value == other, name
    logits = make_logits(rows)
    staged.fill_grammar_bitmask()
    fresh.fill_grammar_bitmask()
    if fresh.grammar_mask is None:
        assert staged.grammar_mask is None
    else:
        assert all(torch.equal(getattr(staged.grammar_mask, name), getattr(fresh.grammar_mask, name))
                   for name in ("bitmask", "rows", "slots"))
    assert Sampler()(logits.clone(), staged).token_ids.tolist() == Sampler()(logits.clone(), fresh).token_ids.tolist()


@pytest.mark.gpu
def test_gpu_uploads_hold_each_steps_values_while_the_stream_is_busy():
    """Uploads through the two pinned buffers while earlier work still runs: each step's kernels read that step's
    values (a later upload never lands before them), and the views are the cached ones."""
    device = torch.device("cuda")
    staging = HostStaging()
    big = torch.randn(2048, 2048, device=device)
    seen, views = [], []
    for step in range(6):
        for _ in range(10):
            big = big @ big / 64  # keep the stream busy: the copies queue behind it
        up = staging.upload("s", {"a": np.arange(3) + 10 * step, "b": np.full(2, step)}, np.int64, device)
        views.append(up["a"])
        seen.append(torch.cat([up["a"], up["b"]]).clone())  # read on the stream, in order
    assert [t.tolist() for t in seen] == [[10 * s, 10 * s + 1, 10 * s + 2, s, s] for s in range(6)]
    assert all(v is views[0] for v in views)


@pytest.mark.gpu
@pytest.mark.parametrize("subset", [None, [0, 3, 9, 14]])
def test_gpu_batches_built_through_uploads_equal_fresh_ones(subset):
    device = torch.device("cuda")
    rows = make_rows()
    rows = rows if subset is None else [rows[i] for i in subset]
    staging = HostStaging()
    SamplingBatch.from_rows(make_rows(), V, device, staging)
    staged = SamplingBatch.from_rows(rows, V, device, staging)
    fresh = SamplingBatch.from_rows(rows, V, device)
    for name, value in _fields(fresh).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, getattr(staged, name)), name
    logits = make_logits(rows).to(device)
    assert Sampler()(logits.clone(), staged).token_ids.tolist() == Sampler()(logits.clone(), fresh).token_ids.tolist()
