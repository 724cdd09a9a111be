"""Host-memory and disk tiers of the prefix cache: where keyed KV blocks go after the GPU pool evicts them.

Recomputing a long shared prefix costs far more than copying its blocks back, so a block the device pool
(pipeline/memory/kv_blocks.py) drops is copied to a pinned host buffer, and a block the host tier drops is
demoted to disk. A later prompt with the same prefix finds how far the tiers reach and the engine copies those
blocks back. A key (pipeline/memory/block_hashes.py) names a block's whole content, so the
tiers never look at tokens.

Both tiers are plain synchronous CPU stores: streams, events and deciding when a copy is done are the engine's.
The disk tier trusts nothing it reads back: every file carries its dtype, shape, length and a checksum of its key
and bytes (so another block's file in its place fails too), and a file that disagrees is deleted and reported
missing, so the engine recomputes the block instead of serving garbage. It works in a private directory of its
own so another process's (or model's) files are never read.
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
import struct
import tempfile
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy

_MAGIC = b"CNVYKV\r\n"  # the \r\n catches a file mangled by newline translation
_VERSION = 2
_FIXED = struct.Struct("<8sHH32sQ16s")  # magic, version, ndim, dtype name, payload length, blake2b digest


def _digest(key: bytes, payload: numpy.ndarray) -> bytes:
    """The checksum a file carries: of its key too, since a file's name alone does not bind it to its key."""
    digest = hashlib.blake2b(key, digest_size=16)
    digest.update(payload)
    return digest.digest()


@dataclass(slots=True)
class TierStats:
    blocks: int = 0  # stored now
    capacity_blocks: int = 0
    bytes_in: int = 0  # payload bytes stored into the tier
    bytes_out: int = 0  # payload bytes loaded out of it
    hits: int = 0
    evictions: int = 0  # entries dropped to make room (host: demoted to the spill tier when there is one)
    corrupt: int = 0  # disk only: files that failed a check on load and were deleted


def _block_nbytes(block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    nbytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes <= 0:
        raise ValueError(f"a KV block of shape {block_shape} holds no bytes")
    return nbytes


def _check_block(block: torch.Tensor, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A block of another shape or dtype would be reinterpreted byte for byte on the way back: refuse it."""
    if tuple(block.shape) != block_shape or block.dtype != dtype:
        raise ValueError(f"expected a {dtype} block of shape {block_shape}, got {block.dtype} {tuple(block.shape)}")


class HostKVTier:
    def __init__(self, capacity_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool = False, spill: DiskKVTier | None = None) -> None:
        """One buffer allocated up front: pinned pages are slow to allocate, and the engine copies to and from
        them asynchronously, so they must not move or be freed while the tier lives."""
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_nbytes = _block_nbytes(self.block_shape, dtype)
        self.capacity_blocks = capacity_bytes // self.block_nbytes
        self.spill = spill
        pin = pin_memory and torch.cuda.is_available()
        self.buffer = torch.empty((self.capacity_blocks, *self.block_shape), dtype=dtype, pin_memory=pin)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free = list(range(self.capacity_blocks - 1, -1, -1))
        self._stats = TierStats(capacity_blocks=self.capacity_blocks)

    @property
    def stats(self) -> TierStats:
        self._stats.blocks = len(self._slots)
        return self._stats

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def victim_slot(self) -> int | None:
        """The slot the next new key would take from another key (None while a slot is free or with capacity 0):
        the engine checks that no copy still uses it."""
        if self._free or not self._slots:
            return None
        return next(iter(self._slots.values()))

    def slot_index(self, key: bytes, read: bool = False) -> int | None:
        """``key``'s slot index, now most recently used (None if absent); ``read``: the engine copies it out (a
        hit, counted with its bytes)."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            if read:
                self._stats.hits += 1
                self._stats.bytes_out += self.block_nbytes
        return slot

    def cancel(self, key: bytes) -> None:
        """Forget ``key``, reserved for a copy the engine called off: its slot never received the block, so it is
        free again and nothing is demoted."""
        self._free.append(self._slots.pop(key))
        self._stats.bytes_in -= self.block_nbytes

    def reserve_slot(self, key: bytes) -> int | None:
        """The slot of ``buffer`` for ``key``, for the engine to fill with an async device->host copy (a key
        present already keeps its slot). The entry counts as present at once, so the engine must not serve it or
        let it be evicted before that copy is done. None with capacity 0."""
        if self.capacity_blocks == 0:
            return None
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            old_key, slot = self._slots.popitem(last=False)
            self._stats.evictions += 1
            if self.spill is not None:
                self.spill.store(old_key, self.buffer[slot])
        self._slots[key] = slot
        self._stats.bytes_in += self.block_nbytes
        return slot


class DiskKVTier:
    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        """Files live in a fresh private subdirectory of ``directory``: what an earlier run or another process
        left there may belong to another model, and is never read."""
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_nbytes = _block_nbytes(self.block_shape, dtype)
        self.capacity_bytes = capacity_bytes
        dtype_name = str(dtype).removeprefix("torch.").encode()
        if len(dtype_name) > 32:
            raise ValueError(f"dtype name {dtype} is too long for the file header")
        self._header_prefix = (_MAGIC, _VERSION, len(self.block_shape), dtype_name.ljust(32, b"\0"), self.block_nbytes)
        self._shape_struct = struct.Struct(f"<{len(self.block_shape)}Q")
        self.file_nbytes = _FIXED.size + self._shape_struct.size + self.block_nbytes
        os.makedirs(directory, exist_ok=True)
        self.path = tempfile.mkdtemp(prefix=f"conveyor-kv-{os.getpid()}-", dir=directory)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)
        self._files: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self.used_bytes = 0
        self._stats = TierStats(capacity_blocks=capacity_bytes // self.file_nbytes)

    @property
    def stats(self) -> TierStats:
        self._stats.blocks = len(self._files)
        return self._stats

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __contains__(self, key: bytes) -> bool:
        return key in self._files

    def __len__(self) -> int:
        return len(self._files)

    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex())

    def store(self, key: bytes, block: torch.Tensor) -> bool:
        """Write ``block`` to its own file, evicting the least recently used files to stay within capacity;
        False when it does not fit at all, the tier is closed, or the write failed (e.g. disk full)."""
        _check_block(block, self.block_shape, self.dtype)
        if key in self._files:
            self._files.move_to_end(key)
            return True
        if self.closed or self.file_nbytes > self.capacity_bytes:
            return False
        while self.used_bytes + self.file_nbytes > self.capacity_bytes:
            self._drop(next(iter(self._files)))
            self._stats.evictions += 1
        payload = block.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        digest = _digest(key, payload)
        header = _FIXED.pack(*self._header_prefix, digest) + self._shape_struct.pack(*self.block_shape)
        fd, tmp = tempfile.mkstemp(dir=self.path, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self._file(key))  # readers see the whole file or none
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        self._files[key] = self.file_nbytes
        self.used_bytes += self.file_nbytes
        self._stats.bytes_in += self.block_nbytes
        return True

    def load(self, key: bytes) -> torch.Tensor | None:
        """A new CPU tensor holding the block, or None if absent or the file fails any check (then it is
        deleted and counted as corrupt: the engine recomputes the block)."""
        if key not in self._files:
            return None
        out = torch.empty(self.block_shape, dtype=self.dtype)
        digest = b""
        payload = out.reshape(-1).view(torch.uint8).numpy()  # read straight into the tensor's memory
        try:
            with open(self._file(key), "rb") as f:
                header = f.read(_FIXED.size + self._shape_struct.size)
                ok = len(header) == _FIXED.size + self._shape_struct.size
                if ok:
                    *prefix, digest = _FIXED.unpack_from(header)
                    shape = self._shape_struct.unpack_from(header, _FIXED.size)
                    ok = tuple(prefix) == self._header_prefix and shape == self.block_shape
                ok = ok and f.readinto(payload) == self.block_nbytes and not f.read(1)
        except OSError:
            ok = False
        if not ok or _digest(key, payload) != digest:
            self._drop(key)
            self._stats.corrupt += 1
            return None
        self._files.move_to_end(key)
        self._stats.hits += 1
        self._stats.bytes_out += self.block_nbytes
        return out

    def _drop(self, key: bytes) -> None:
        self.used_bytes -= self._files.pop(key)
        try:
            os.unlink(self._file(key))
        except OSError:
            pass

    def close(self) -> None:
        """Delete the private directory and everything in it; safe to call twice."""
        self._files.clear()
        self.used_bytes = 0
        self._finalizer()
