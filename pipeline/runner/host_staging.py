"""Host buffers a runner reuses step after step, and the tensor views of them it has already made.

On the device thread every torch call releases the GIL, and the event loop, busy with the previous
step's outputs, takes it: a call of a microsecond can then cost the step up to the switch interval
(host bench, batch 256: a step's ~8 small torch calls cost ~0.6 ms of waiting). So a step's small
host arrays are written with numpy into buffers made once, and each tensor view of them is made
once per (offset, length, shape) and looked up afterwards: in steady state, staging a step's
sampling inputs and its grammar bitmask costs no torch call.

On a GPU the same arrays go up through ``upload``: written into one of two pinned host buffers, used in
turn, and copied whole into a device buffer in one call, whose views are cached the same way. A fresh
pinned tensor, its copy and its views cost ~0.3 ms of host time a step, on the critical path of a
speculative cycle (bench/README.md). The device buffer is rewritten by the next step's copy, which the
stream orders after this step's kernels; a pinned buffer is rewritten only once the copy that read it
two uploads ago has run.

A view is valid until the owner's next step writes the buffer again. Only the thread that runs the
steps uses a staging (the runner's device thread), and on CPU a step has sampled before it returns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

# Views are cached per (offset, length, shape) and per stage() layout; batches of many different
# sizes would grow either cache without bound, so past this many entries it starts again.
MAX_CACHED_VIEWS = 4096


@dataclass(slots=True)
class _Pinned:
    tensor: Tensor  # 1-D pinned host memory
    array: np.ndarray  # the same memory
    copied: torch.cuda.Event | None = None  # recorded after the last copy that read it
    prefixes: dict[int, Tensor] = field(default_factory=dict)  # its first n elements, by n


@dataclass(slots=True)
class _Buffer:
    tensor: Tensor  # 1-D, the whole buffer (an upload's: on the device)
    array: np.ndarray | None  # the same memory, for writing without torch calls (None on the device)
    views: dict[tuple[int, int, tuple[int, ...]], Tensor] = field(default_factory=dict)
    # a stage() call's (keys, lengths) -> its views by key
    layouts: dict[tuple[tuple[str, ...], tuple[int, ...]], dict[str, Tensor]] = field(default_factory=dict)
    pinned: list[_Pinned] = field(default_factory=list)  # an upload's two host buffers, used in turn
    turn: int = 0


class HostStaging:
    def __init__(self) -> None:
        self._buffers: dict[tuple[str, np.dtype], _Buffer] = {}

    def stage(self, name: str, arrays: dict[str, np.ndarray], dtype: type) -> dict[str, Tensor]:
        """Copies `arrays` (all of `dtype`) back to back into the buffer `name` (one numpy call) and
        returns a 1-D tensor view of each, by key (one lookup when the layout was seen before; the
        dict is the cached one: read it, do not change it)."""
        lengths = tuple(len(values) for values in arrays.values())
        total = sum(lengths)
        buffer = self._buffer(name, dtype, total)
        if total:
            np.concatenate(list(arrays.values()), out=buffer.array[:total])
        return self._views(buffer, arrays, lengths)

    def upload(self, name: str, arrays: dict[str, np.ndarray], dtype: type, device: torch.device) -> dict[str, Tensor]:
        """``stage`` onto a GPU: the arrays through a pinned buffer, one copy into the device buffer ``name``;
        returns a device view of each, by key (cached as ``stage``'s are). Nothing waits for the device."""
        lengths = tuple(len(values) for values in arrays.values())
        total = sum(lengths)
        if total:
            np.concatenate(list(arrays.values()), out=self.host_buffer(name, dtype, total, device))
            self.send(name, dtype, total, device)
        return self._views(self._device_buffer(name, dtype, total, device), arrays, lengths)

    def host_buffer(self, name: str, dtype: type, size: int, device: torch.device) -> np.ndarray:
        """``size`` elements of host memory to write the next upload ``name`` into, in place, before ``send``: on a
        GPU one of the upload's two pinned buffers, in turn (once the copy that read it two uploads ago has run: long
        done, its step launched since), elsewhere the staging's buffer ``name`` itself."""
        if device.type != "cuda":
            return self._buffer(name, dtype, size).array[:size]
        buffer = self._device_buffer(name, dtype, size, device)
        pinned = buffer.pinned[buffer.turn]
        if pinned.copied is not None:
            pinned.copied.synchronize()
        return pinned.array[:size]

    def send(self, name: str, dtype: type, size: int, device: torch.device,
             shapes: tuple[tuple[int, ...], ...] = ()) -> list[Tensor]:
        """The first ``size`` elements written into ``host_buffer(name)`` on ``device``: on a GPU one non-blocking
        copy into the device buffer ``name``, elsewhere the host buffer itself. Returns views of consecutive parts
        of them in ``shapes`` (cached, as every view here)."""
        if device.type != "cuda":
            return self._shaped(self._buffer(name, dtype, size), shapes)
        buffer = self._device_buffer(name, dtype, size, device)
        pinned = buffer.pinned[buffer.turn]
        source = pinned.prefixes.get(size)
        if source is None:
            if len(pinned.prefixes) >= MAX_CACHED_VIEWS:
                pinned.prefixes.clear()
            source = pinned.prefixes[size] = pinned.tensor[:size]
        self._view(buffer, 0, size, (size,)).copy_(source, non_blocking=True)
        if pinned.copied is None:
            pinned.copied = torch.cuda.Event()
        pinned.copied.record()
        buffer.turn ^= 1
        return self._shaped(buffer, shapes)

    def _shaped(self, buffer: _Buffer, shapes: tuple[tuple[int, ...], ...]) -> list[Tensor]:
        views, offset = [], 0
        for shape in shapes:
            length = math.prod(shape)
            views.append(self._view(buffer, offset, length, shape))
            offset += length
        return views

    def _views(self, buffer: _Buffer, arrays: dict[str, np.ndarray],
               lengths: tuple[int, ...]) -> dict[str, Tensor]:
        layout = (tuple(arrays), lengths)
        views = buffer.layouts.get(layout)
        if views is None:
            if len(buffer.layouts) >= MAX_CACHED_VIEWS:
                buffer.layouts.clear()
            views, offset = {}, 0
            for key, length in zip(arrays, lengths):
                views[key] = self._view(buffer, offset, length, (length,))
                offset += length
            buffer.layouts[layout] = views
        return views

    def reshaped(self, name: str, dtype: type, view: Tensor, shape: tuple[int, ...]) -> Tensor:
        """`view` (one this staging returned from buffer `name`) in another shape, cached like it."""
        buffer = self._buffers[(name, np.dtype(dtype))]
        offset = view.storage_offset() - buffer.tensor.storage_offset()
        return self._view(buffer, offset, view.numel(), shape)

    def matrix(self, name: str, dtype: type, rows: int, columns: int) -> tuple[np.ndarray, Tensor]:
        """The first rows x columns of buffer `name` as a C-contiguous array and its tensor view."""
        buffer = self._buffer(name, dtype, rows * columns)
        view = self._view(buffer, 0, rows * columns, (rows, columns))
        return buffer.array[:rows * columns].reshape(rows, columns), view

    def _device_buffer(self, name: str, dtype: type, size: int, device: torch.device) -> _Buffer:
        key = (name, np.dtype(dtype))
        buffer = self._buffers.get(key)
        if buffer is None or len(buffer.tensor) < size:
            capacity = max(size, 2 * len(buffer.tensor) if buffer is not None else 256)
            pinned = []
            for _ in range(2):
                host = torch.empty(capacity, dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype, pin_memory=True)
                pinned.append(_Pinned(host, host.numpy()))
            buffer = self._buffers[key] = _Buffer(torch.empty(capacity, dtype=host.dtype, device=device), None,
                                                  pinned=pinned)
        return buffer

    def _buffer(self, name: str, dtype: type, size: int) -> _Buffer:
        key = (name, np.dtype(dtype))
        buffer = self._buffers.get(key)
        if buffer is None or len(buffer.array) < size:
            capacity = max(size, 2 * len(buffer.array) if buffer is not None else 64)
            array = np.empty(capacity, dtype=dtype)
            buffer = self._buffers[key] = _Buffer(torch.from_numpy(array), array)
        return buffer

    @staticmethod
    def _view(buffer: _Buffer, offset: int, length: int, shape: tuple[int, ...]) -> Tensor:
        key = (offset, length, shape)
        view = buffer.views.get(key)
        if view is None:
            if len(buffer.views) >= MAX_CACHED_VIEWS:
                buffer.views.clear()
            view = buffer.views[key] = buffer.tensor[offset:offset + length].view(shape)
        return view


def queue_host_copy(tensor: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """A host copy of ``tensor`` queued behind the kernels that write it, and the event recorded after it (None on
    CPU, where the tensor is its own copy): nothing waits now, ``event.synchronize()`` waits for this copy alone."""
    if not tensor.is_cuda:
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied
