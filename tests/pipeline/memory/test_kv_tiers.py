import os

import pytest
import torch

from pipeline.memory.kv_tiers import DiskKVTier, HostKVTier

SHAPE = (2, 2, 4, 3)  # [layers, k/v, block_size, head_dim]: small, but each axis is distinct


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def block(seed: int, dtype: torch.dtype = torch.bfloat16, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def nbytes(dtype: torch.dtype = torch.bfloat16) -> int:
    return block(0, dtype).numel() * block(0, dtype).element_size()


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Compares bytes, so a NaN payload or a -0.0/+0.0 swap would still be caught."""
    assert a.dtype == b.dtype and a.shape == b.shape
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def put(tier: HostKVTier, k: bytes, b: torch.Tensor) -> bool:
    """As the engine saves a block: a key present is only touched, a new one gets a slot that is then filled."""
    if k in tier:
        tier.slot_index(k)
        return True
    slot = tier.reserve_slot(k)
    if slot is not None:
        tier.buffer[slot].copy_(b)
    return slot is not None


def read(tier: HostKVTier, k: bytes) -> torch.Tensor | None:
    """As the engine restores a block: the slot's contents, a hit."""
    slot = tier.slot_index(k, read=True)
    return None if slot is None else tier.buffer[slot]


def disk(tmp_path, blocks: float, dtype: torch.dtype = torch.bfloat16, shape: tuple[int, ...] = SHAPE) -> DiskKVTier:
    probe = DiskKVTier(tmp_path, 0, shape, dtype)
    file_nbytes = probe.file_nbytes
    probe.close()
    return DiskKVTier(tmp_path, int(blocks * file_nbytes), shape, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_round_trip_is_bit_exact(dtype):
    tier = HostKVTier(4 * nbytes(dtype), SHAPE, dtype)
    assert tier.capacity_blocks == 4 and tier.block_nbytes == nbytes(dtype)
    assert tuple(tier.buffer.shape) == (4, *SHAPE) and tier.buffer.dtype == dtype
    original = block(1, dtype)
    assert put(tier, key(1), original)
    assert bit_equal(read(tier, key(1)), original)
    assert read(tier, key(2)) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_disk_round_trip_is_bit_exact(tmp_path, dtype):
    tier = disk(tmp_path, 4, dtype)
    original = block(1, dtype)
    original.view(-1)[0] = float("nan")
    assert tier.store(key(1), original)
    loaded = tier.load(key(1))
    assert loaded is not None and loaded.device.type == "cpu" and bit_equal(loaded, original)
    assert tier.load(key(2)) is None and tier.stats.corrupt == 0


def test_disk_stores_a_non_contiguous_block(tmp_path):
    tier = disk(tmp_path, 2)
    wide = block(3, shape=(*SHAPE[:-1], SHAPE[-1] * 2))
    strided = wide[..., ::2]
    assert not strided.is_contiguous()
    tier.store(key(1), strided)
    assert bit_equal(tier.load(key(1)), strided.contiguous())


def test_host_lru_evicts_least_recently_used_and_lookups_touch():
    tier = HostKVTier(3 * nbytes(), SHAPE, torch.bfloat16)
    for i in range(3):
        put(tier, key(i), block(i))
    tier.slot_index(key(0))  # order now 1, 2, 0
    read(tier, key(1))  # order now 2, 0, 1
    put(tier, key(3), block(3))
    assert key(2) not in tier and all(key(i) in tier for i in (0, 1, 3))
    put(tier, key(0), block(99))  # present: only touched, content unchanged; order 1, 3, 0
    put(tier, key(4), block(4))
    assert key(1) not in tier and len(tier) == 3 and tier.stats.evictions == 2
    for i in (0, 3, 4):  # slots reused by eviction still hold the right blocks
        assert bit_equal(read(tier, key(i)), block(i))


def test_host_victim_slot_is_the_least_recently_used_once_full():
    tier = HostKVTier(2 * nbytes(), SHAPE, torch.bfloat16)
    assert tier.victim_slot() is None
    put(tier, key(1), block(1))
    assert tier.victim_slot() is None  # a slot is still free
    put(tier, key(2), block(2))
    first, second = tier.slot_index(key(2)), tier.slot_index(key(1))  # order now 2, 1
    assert tier.victim_slot() == first
    assert tier.reserve_slot(key(3)) == first and key(2) not in tier and tier.victim_slot() == second


def test_host_reserve_slot_keeps_a_present_key_in_its_slot():
    tier = HostKVTier(2 * nbytes(), SHAPE, torch.bfloat16)
    slot = tier.reserve_slot(key(1))
    assert key(1) in tier and slot == tier.slot_index(key(1))
    tier.buffer[slot].copy_(block(1))
    assert bit_equal(read(tier, key(1)), block(1))
    assert tier.reserve_slot(key(1)) == slot and len(tier) == 1 and tier.stats.bytes_in == nbytes()


def test_host_stats():
    tier = HostKVTier(2 * nbytes() + 5, SHAPE, torch.bfloat16)
    for i in range(3):
        put(tier, key(i), block(i))
    put(tier, key(2), block(2))  # already present: no bytes move
    read(tier, key(2))
    read(tier, key(2))
    read(tier, key(0))  # evicted: a miss
    tier.slot_index(key(1))  # a use, not a read
    stats = tier.stats
    assert (stats.blocks, stats.capacity_blocks, stats.evictions, stats.hits, stats.corrupt) == (2, 2, 1, 2, 0)
    assert stats.bytes_in == 3 * nbytes() and stats.bytes_out == 2 * nbytes()


def test_host_eviction_spills_to_disk_bit_exact(tmp_path):
    spill = disk(tmp_path, 4)
    tier = HostKVTier(2 * nbytes(), SHAPE, torch.bfloat16, spill=spill)
    for i in range(3):
        put(tier, key(i), block(i))
    assert key(0) not in tier and key(0) in spill and len(spill) == 1
    assert bit_equal(spill.load(key(0)), block(0))
    tier.slot_index(key(1))
    put(tier, key(3), block(3))  # key 2 is now the least recently used
    assert key(2) in spill and key(1) not in spill and bit_equal(spill.load(key(2)), block(2))


def test_store_rejects_wrong_shape_or_dtype(tmp_path):
    store = disk(tmp_path, 2)
    with pytest.raises(ValueError):
        store.store(key(1), block(1, torch.float32))
    with pytest.raises(ValueError):
        store.store(key(1), block(1, shape=(2, 2, 3, 4)))
    assert key(1) not in store and os.listdir(store.path) == []


def test_capacity_zero_stores_nothing(tmp_path):
    host = HostKVTier(0, SHAPE, torch.bfloat16)
    assert host.capacity_blocks == 0 and host.buffer.shape[0] == 0
    assert host.reserve_slot(key(1)) is None and not put(host, key(1), block(1)) and len(host) == 0
    small = HostKVTier(nbytes() - 1, SHAPE, torch.bfloat16)
    assert small.capacity_blocks == 0 and not put(small, key(1), block(1))
    store = disk(tmp_path, 0)
    assert not store.store(key(1), block(1)) and len(store) == 0 and os.listdir(store.path) == []
    too_small = disk(tmp_path, 0.99)  # a block bigger than the whole capacity
    assert not too_small.store(key(1), block(1)) and os.listdir(too_small.path) == []


def test_disk_lru_and_capacity_by_bytes(tmp_path):
    tier = disk(tmp_path, 3.5)
    assert tier.stats.capacity_blocks == 3
    for i in range(3):
        tier.store(key(i), block(i))
    assert tier.load(key(0)) is not None  # order now 1, 2, 0
    tier.store(key(3), block(3))
    assert key(1) not in tier and not os.path.exists(os.path.join(tier.path, key(1).hex()))
    tier.store(key(2), block(99))  # present: only touched, file unchanged; order now 0, 3, 2
    tier.store(key(4), block(4))
    assert key(0) not in tier and bit_equal(tier.load(key(2)), block(2))
    for i in range(5, 10):
        tier.store(key(i), block(i))
        files = os.listdir(tier.path)
        size = sum(os.path.getsize(os.path.join(tier.path, name)) for name in files)
        assert len(files) == 3 and size <= tier.capacity_bytes and size == tier.used_bytes
    assert sorted(files) == sorted(key(i).hex() for i in (7, 8, 9))
    assert tier.stats.evictions == 7 and [k in tier for k in (key(7), key(8), key(1), key(9))] == [True, True,
                                                                                                  False, True]


def test_disk_stats(tmp_path):
    tier = disk(tmp_path, 4)
    tier.store(key(1), block(1))
    tier.store(key(1), block(1))
    tier.load(key(1))
    tier.load(key(2))
    stats = tier.stats
    assert (stats.blocks, stats.hits, stats.bytes_in, stats.bytes_out) == (1, 1, nbytes(), nbytes())


def corrupt_flip_payload_byte(tmp_path, path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte ^ 0x01]))


def corrupt_truncate(tmp_path, path):
    os.truncate(path, os.path.getsize(path) - 1)


def corrupt_append(tmp_path, path):
    with open(path, "ab") as f:
        f.write(b"\0")


def corrupt_magic(tmp_path, path):
    with open(path, "r+b") as f:
        f.write(b"XXXX")


def corrupt_delete(tmp_path, path):
    os.remove(path)


def corrupt_empty(tmp_path, path):
    open(path, "wb").close()


def _swap_in_file_of(tmp_path, path, shape, dtype):
    """A well-formed file (valid checksum, same payload length) written by a tier of another shape or dtype."""
    other = DiskKVTier(tmp_path / "other", 10**6, shape, dtype)
    data = block(1, dtype, shape)
    other.store(key(1), data)
    os.replace(os.path.join(other.path, key(1).hex()), path)
    other.close()


def corrupt_other_shape(tmp_path, path):
    _swap_in_file_of(tmp_path, path, (2, 2, 3, 4), torch.bfloat16)


def corrupt_other_dtype(tmp_path, path):
    _swap_in_file_of(tmp_path, path, SHAPE, torch.float16)


def corrupt_other_key(tmp_path, path):
    """The same tier's well-formed file of another block (key 2's) under this name."""
    with open(os.path.join(os.path.dirname(path), key(2).hex()), "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("corrupt", [corrupt_flip_payload_byte, corrupt_truncate, corrupt_append, corrupt_magic,
                                     corrupt_delete, corrupt_empty, corrupt_other_shape, corrupt_other_dtype,
                                     corrupt_other_key])
def test_disk_corruption_is_detected_and_dropped(tmp_path, corrupt):
    tier = disk(tmp_path, 4)
    tier.store(key(1), block(1))
    tier.store(key(2), block(2))
    path = os.path.join(tier.path, key(1).hex())
    corrupt(tmp_path, path)
    assert tier.load(key(1)) is None
    assert tier.stats.corrupt == 1 and key(1) not in tier and not os.path.exists(path)
    assert tier.used_bytes == tier.file_nbytes and tier.stats.hits == 0
    assert tier.load(key(1)) is None and tier.stats.corrupt == 1  # now a plain miss
    assert bit_equal(tier.load(key(2)), block(2))  # the neighbour is untouched
    assert tier.store(key(1), block(1)) and bit_equal(tier.load(key(1)), block(1))  # recomputed and stored again


def test_disk_private_directories_and_close(tmp_path):
    first = DiskKVTier(tmp_path, 10**6, SHAPE, torch.bfloat16)
    first.store(key(1), block(1))
    second = DiskKVTier(tmp_path, 10**6, SHAPE, torch.bfloat16)
    assert first.path != second.path and os.path.dirname(first.path) == str(tmp_path)
    assert os.path.basename(first.path).startswith(f"conveyor-kv-{os.getpid()}-")
    assert key(1) not in second and second.load(key(1)) is None
    first.close()
    assert not os.path.exists(first.path) and first.closed and len(first) == 0
    first.close()  # idempotent
    assert first.load(key(1)) is None and not first.store(key(1), block(1))
    second.store(key(2), block(2))
    path = second.path
    del second  # the finalizer cleans up a tier nobody closed
    assert not os.path.exists(path) and os.listdir(tmp_path) == []
