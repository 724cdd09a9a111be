"""Step plans are arrays built once: rows of any length, logits where asked, fed tokens by row, a
snapshot of the block lists, and a forward batch that crosses a process boundary as bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.runner.step_plan import (
    FORWARD_BATCH_VERSION,
    ForwardBatch,
    ForwardBatchVersionError,
    ScheduledChunk,
    build_step_plan,
)


def sample_chunks() -> list[ScheduledChunk]:
    return [
        ScheduledChunk([5], 9, [3, 7, 8], ["decode"], previous_row=2),  # one token fed from the device
        ScheduledChunk([0, 41, 42, 43], 6, [4, 9, 10], ["v0", "v1", "v2", "v3"], previous_row=0,
                       logits_offsets=[0, 1, 2, 3]),  # a verify row: fed token + 3 drafts
        ScheduledChunk([1, 2, 3, 4, 5], 0, [11, 12], []),  # a prompt chunk short of its end
        ScheduledChunk([6, 7], 5, [11, 12], ["n0", "n1"]),  # a prompt's last chunk, n = 2
    ]


def test_build_flattens_rows_of_any_length() -> None:
    plan = build_step_plan(sample_chunks(), block_size=4)
    f = plan.forward
    assert f.query_start_loc.tolist() == [0, 1, 5, 10, 12]
    assert f.positions.tolist() == [9, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6]
    assert f.seq_lens.tolist() == [10, 10, 5, 7]
    assert f.slot_mapping.tolist()[:5] == [8 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3, 10 * 4 + 0, 10 * 4 + 1]
    assert f.logits_indices.tolist() == [0, 1, 2, 3, 4, 11, 11]
    assert f.feed_targets.tolist() == [0, 1] and f.feed_sources.tolist() == [2, 0]
    assert plan.rows == ("decode", "v0", "v1", "v2", "v3", "n0", "n1") and plan.num_rows == 7
    assert f.block_tables.tolist() == [[3, 7, 8], [4, 9, 10], [11, 12, 0], [11, 12, 0]]


def test_a_plan_is_a_snapshot_of_the_block_lists() -> None:
    table = [3, 7]
    plan = build_step_plan([ScheduledChunk([1, 2], 5, table, ["r"])], block_size=4)
    table.append(99)  # the event loop grows the sequence after the plan was built
    table[0] = 42
    assert plan.forward.block_tables.tolist() == [[3, 7]]
    assert plan.forward.slot_mapping.tolist() == [7 * 4 + 1, 7 * 4 + 2]


def test_logits_offsets_must_match_the_rows() -> None:
    with pytest.raises(ValueError, match="logits offsets"):
        build_step_plan([ScheduledChunk([1, 2], 0, [1], ["a", "b"], logits_offsets=[0])], block_size=4)
    with pytest.raises(ValueError, match="logits offsets"):
        build_step_plan([ScheduledChunk([1, 2], 0, [1], ["a"], logits_offsets=[2])], block_size=4)
    with pytest.raises(ValueError, match="cannot hold"):
        build_step_plan([ScheduledChunk([1, 2], 3, [1], ["a"])], block_size=4)


def test_drafts_left_on_the_device_feed_their_verify_rows() -> None:
    """Two verify rows take their drafts from the drafter's ids on the device (row i's at i * k), one of them with
    filler drafts after them; the plan names that tensor as what its feeds index."""
    drafts = torch.tensor([[41, 42, 43], [51, 52, 53]]).view(-1)
    chunks = [ScheduledChunk([7, 0, 0, 0], 6, [4, 9, 10], ["a0", "a1", "a2", "a3"], logits_offsets=[0, 1, 2, 3],
                             fed_drafts=(drafts, 1, 3, 3)),
              ScheduledChunk([5, 6, 0, 0, 0, 6], 2, [1, 2], [f"b{i}" for i in range(5)],
                             logits_offsets=[1, 2, 3, 4, 5], fed_drafts=(drafts, 2, 0, 3)),
              ScheduledChunk([1, 2], 0, [11], ["p"])]
    plan = build_step_plan(chunks, block_size=4)
    f = plan.forward
    assert plan.fed_tokens is drafts
    assert f.feed_targets.tolist() == [1, 2, 3, 6, 7, 8] and f.feed_sources.tolist() == [3, 4, 5, 0, 1, 2]
    fed = f.input_ids.copy()
    fed[f.feed_targets] = drafts.numpy()[f.feed_sources]
    assert fed.tolist() == [7, 51, 52, 53, 5, 6, 41, 42, 43, 6, 1, 2]
    assert build_step_plan(chunks[2:], block_size=4).fed_tokens is None


def test_fed_drafts_are_checked() -> None:
    drafts = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="fed drafts at offset"):
        build_step_plan([ScheduledChunk([7, 0, 0], 0, [1], ["a"], fed_drafts=(drafts, 1, 0, 3))], block_size=4)
    with pytest.raises(ValueError, match="another device tensor"):
        build_step_plan([ScheduledChunk([7, 0], 0, [1], ["a"], fed_drafts=(drafts, 1, 0, 1)),
                         ScheduledChunk([8, 0], 0, [2], ["b"], fed_drafts=(drafts.clone(), 1, 1, 1))], block_size=4)
    with pytest.raises(ValueError, match="not both"):
        build_step_plan([ScheduledChunk([7, 0], 0, [1], ["a"], fed_drafts=(drafts, 1, 0, 1)),
                         ScheduledChunk([0], 3, [2], ["b"], previous_row=0)], block_size=4)


def test_a_forward_batch_serialises_to_the_same_arrays() -> None:
    batch = build_step_plan(sample_chunks(), block_size=4).forward
    data = batch.to_bytes()
    back = ForwardBatch.from_bytes(data)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                 "logits_indices", "feed_targets", "feed_sources", "state_slots", "keep_slots"):
        original, received = getattr(batch, name), getattr(back, name)
        assert received.dtype == original.dtype and np.array_equal(received, original), name
    assert back.version == FORWARD_BATCH_VERSION
    empty = build_step_plan([ScheduledChunk([1], 0, [1], [])], block_size=4).forward
    assert ForwardBatch.from_bytes(empty.to_bytes()).num_logits == 0


def test_a_forward_batch_of_another_version_is_refused() -> None:
    data = bytearray(build_step_plan(sample_chunks(), block_size=4).forward.to_bytes())
    data[:8] = np.array([FORWARD_BATCH_VERSION + 1], dtype=np.int64).tobytes()
    with pytest.raises(ForwardBatchVersionError, match="version"):
        ForwardBatch.from_bytes(bytes(data))
    with pytest.raises(ValueError, match="bytes"):
        ForwardBatch.from_bytes(build_step_plan(sample_chunks(), block_size=4).forward.to_bytes() + b"\0" * 8)


def test_uniform_decode_is_what_a_cuda_graph_can_replay() -> None:
    decode = build_step_plan([ScheduledChunk([1], 4, [1, 2], ["a"]), ScheduledChunk([2], 7, [3, 4], ["b"])], 4)
    verify = build_step_plan([ScheduledChunk([1, 2, 3], 4, [1, 2], ["a", "b", "c"], logits_offsets=[0, 1, 2])], 4)
    prompt = build_step_plan([ScheduledChunk([1, 2, 3], 0, [1], ["a"])], 4)
    mixed = build_step_plan([ScheduledChunk([1], 4, [1, 2], ["a"]),
                             ScheduledChunk([1, 2], 4, [3, 4], ["a", "b"], logits_offsets=[0, 1])], 4)
    assert decode.forward.is_uniform_decode and verify.forward.is_uniform_decode
    assert not prompt.forward.is_uniform_decode and not mixed.forward.is_uniform_decode
