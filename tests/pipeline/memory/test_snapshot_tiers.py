"""The snapshots' host tier (pipeline/memory/snapshot_tiers.py): the device pool's evictions demoted to host, host
snapshots promoted back when a prompt pins them, host slots never reused under a copy, and the copies' bytes."""
from __future__ import annotations

import pytest
import torch

from pipeline.config import EngineConfig
from pipeline.memory.block_transfers import BlockTransfers, run_block_transfers
from pipeline.memory.snapshot_tiers import TieredSnapshots, snapshot_host_gib, snapshot_pool
from pipeline.memory.state_snapshots import SnapshotPool, snapshot_stats


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def tiered(device: int = 2, host: int = 2) -> TieredSnapshots:
    return TieredSnapshots(device, 16, host, 64)


def plan(snaps: TieredSnapshots) -> BlockTransfers:
    """What the cache manager does when it builds a plan: the device pool's queued copies handed, the host ones
    taken."""
    snaps.handed()
    transfers = BlockTransfers(None)
    snaps.take_copies(transfers)
    return transfers


def test_an_evicted_snapshot_is_demoted_and_promoted_back_when_pinned():
    snaps = tiered()
    a, b = snaps.reserve(key(1)), snaps.reserve(key(2))
    plan(snaps)
    c = snaps.reserve(key(3))  # evicts key 1 (least recently used): demoted first
    assert c == a and not snaps.on_device(key(1)) and key(1) in snaps
    first = plan(snaps)
    assert first.snapshot_saves == [(a, 0)] and first.snapshot_loads == [] and first.snapshot_host is snaps.buffer
    assert snaps.latest([key(0), key(1), key(9)]) == 2  # host snapshots count
    pinned = snaps.pin(key(1))  # promoted into the least recently used device snapshot (key 2's, demoted too)
    assert pinned == b and snaps.on_device(key(1)) and key(2) in snaps and not snaps.on_device(key(2))
    second = plan(snaps)
    assert second.snapshot_saves == [(b, 1)] and second.snapshot_loads == [(0, b)]
    stats = snapshot_stats(snaps)
    assert stats["host"]["demoted"] == 2 and stats["host"]["promoted"] == 1 and stats["host"]["held"] == 2
    assert stats["capacity"] == 2 and stats["pinned"] == 1


def test_a_key_on_host_already_is_not_copied_again_and_pin_fails_without_device_room():
    snaps = tiered(device=1)
    snaps.reserve(key(1))
    plan(snaps)
    snaps.reserve(key(2))  # key 1 demoted
    plan(snaps)
    assert snaps.pin(key(1)) is not None  # promoted (key 2 demoted): key 1 now on host and on device
    plan(snaps)
    assert snaps.pin(key(2)) is None  # the one device snapshot is pinned: no room to promote into
    index = SnapshotPool.pin(snaps, key(1))
    snaps.unpin(index)
    snaps.unpin(index)
    snaps.reserve(key(3))  # evicts key 1 again: host holds it, nothing copied
    assert plan(snaps).snapshot_saves == [] and snaps.host_stats.kept == 1


def test_host_slots_under_a_copy_are_not_reused():
    snaps = tiered(device=1, host=1)
    snaps.reserve(key(1))
    plan(snaps)
    snaps.reserve(key(2))  # key 1 demoted into the one host slot ...
    snaps.handed()
    snaps.reserve(key(3))  # ... whose copy is still queued: key 2 cannot be demoted
    assert snaps.host_stats.dropped == 1 and key(2) not in snaps
    transfers = plan(snaps)
    snaps.reserve(key(4))  # the copy is handed but has not landed: key 3 dropped too
    assert snaps.host_stats.dropped == 2
    transfers.done.set()  # (a CPU runner: landed once run)
    plan(snaps)
    snaps.reserve(key(5))  # key 4 demoted over key 1's slot
    assert key(4) in snaps and key(1) not in snaps and snaps.host_stats.evictions == 1


def test_demotion_and_promotion_move_the_bytes_of_every_recurrent_cache():
    conv = torch.randn(3, 4, 3).to(torch.bfloat16)
    rec = torch.randn(3, 2, 5, 5)
    nbytes = conv[0].numel() * 2 + rec[0].numel() * 4
    snaps = TieredSnapshots(3, 16, 2, nbytes)
    snaps._index[key(7)] = 1  # (as if a save had filled snapshot 1)
    snaps._free.remove(1)
    saved = (conv[1].clone(), rec[1].clone())
    snaps.evicted(key(7), 1)
    run_block_transfers(plan(snaps), [], [], [conv, rec])
    conv[1].zero_()
    rec[1].zero_()
    del snaps._index[key(7)]
    snaps._free.append(1)
    index = snaps.pin(key(7))
    run_block_transfers(plan(snaps), [], [], [conv, rec])
    assert torch.equal(conv[index], saved[0]) and torch.equal(rec[index], saved[1])


def test_the_host_share_of_a_hybrid_model():
    config = EngineConfig(model="m", kv_offload_host_gib=8.0)
    assert snapshot_host_gib(config, True) == 2.0 and snapshot_host_gib(config, False) == 0.0
    assert snapshot_host_gib(EngineConfig(model="m", kv_offload_host_gib=8.0, state_snapshot_host_gib=0.5), True) == 0.5
    assert snapshot_host_gib(EngineConfig(model="m"), True) == 0.0
    assert isinstance(snapshot_pool(config, 4, 1 << 20, False), TieredSnapshots)
    assert type(snapshot_pool(EngineConfig(model="m"), 4, 1 << 20, False)) is SnapshotPool
    with pytest.raises(ValueError, match="part of kv_offload_host_gib"):
        EngineConfig(model="m", kv_offload_host_gib=1.0, state_snapshot_host_gib=2.0).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream is CUDA's")
def test_snapshot_copies_on_a_copy_stream_keep_step_order():
    """A demotion is gathered before the plan's state save overwrites its snapshot; a promotion lands before the
    state load that reads it (both queued right after, on the compute stream)."""
    conv = torch.randn(4, 64, 3, device="cuda").to(torch.bfloat16)
    rec = torch.randn(4, 8, 64, 64, device="cuda")
    states = [torch.randn(2, *conv.shape[1:], device="cuda").to(torch.bfloat16),
              torch.randn(2, *rec.shape[1:], device="cuda")]
    nbytes = conv[0].numel() * 2 + rec[0].numel() * 4
    snaps = TieredSnapshots(1, 16, 2, nbytes, pin_memory=True)
    side = torch.cuda.Stream()
    snaps.reserve(key(1))  # snapshot 0 holds key 1 (its content: conv[0], rec[0])
    plan(snaps)
    old = (conv[0].clone(), rec[0].clone())
    index = snaps.reserve(key(2))  # key 1 demoted, then state slot 1 saved over snapshot 0 in the same plan
    transfers = plan(snaps)
    transfers.state_saves = [(1, index)]
    run_block_transfers(transfers, [], states, [conv, rec], copy_stream=side)
    assert torch.equal(conv[0], states[0][1]) and torch.equal(rec[0], states[1][1])
    pinned = snaps.pin(key(1))  # key 2 demoted, key 1 promoted into snapshot 0, then loaded into state slot 0
    snaps.read(pinned)
    transfers = plan(snaps)
    transfers.state_loads = [(pinned, 0)]
    run_block_transfers(transfers, [], states, [conv, rec], copy_stream=side)
    early = (states[0][0].clone(), states[1][0].clone())  # read on the compute stream right after
    assert transfers.wait(10.0)
    assert torch.equal(early[0], old[0]) and torch.equal(early[1], old[1])
