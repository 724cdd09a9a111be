"""Triton, when installed. CPU-only installs may lack it: kernel modules still import (their torch
references work) and `jit` leaves the kernel functions undecorated; they are never launched there.

`jit(do_not_specialize=[...])` names integer arguments that change from step to step (sequence counts, block
table widths, slot counts): Triton otherwise compiles a variant per value class (1, a multiple of 16, other),
and a serving step that first meets a new class waits a second for the compiler.

Programmatic dependent launch (PDL, Hopper and later): a decode step is a chain of a few hundred small kernels, and
each one otherwise starts only after the one before has drained: launch, the first DRAM round trip and the tail of
every kernel leave the memory system idle. A kernel launched with ``pdl_launch(t)`` (``PDL=True`` and Triton's
``launch_pdl``) lets the next kernel start as soon as its own programs are all running (``gdc_launch_dependents``),
and it starts the same way: it may read what no kernel writes (its weights) at once, then ``gdc_wait``s for the
kernel before it to finish before it reads an activation or writes anything. Every program of such a kernel waits,
unconditionally, before it writes or exits, so 'the kernel before finished' means 'every kernel before finished'.
``CONVEYOR_PDL=0`` turns it off (read once, at the first launch on a device)."""
from __future__ import annotations

import functools
import os

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:
    triton = tl = None

    def jit(fn=None, **_options):  # type: ignore[no-redef]
        return fn if fn is not None else (lambda f: f)

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no triton, or one without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the Triton interpreter runs the kernels (CPU tests)


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    import torch

    return (gdc_wait is not None and not INTERPRET and os.environ.get("CONVEYOR_PDL", "1") != "0"
            and torch.cuda.get_device_capability(device_index)[0] >= 9)


def pdl_launch(t) -> dict[str, bool]:
    """Launch keywords for a kernel with a ``PDL`` constexpr, for tensor ``t``'s device: ``{}`` (PDL off: the
    kernel's default ``PDL=False`` and an ordinary launch) unless the device supports dependent launch."""
    if not t.is_cuda or not _pdl_supported(t.device.index or 0):
        return {}
    return {"PDL": True, "launch_pdl": True}


# L2 weight hints (Hopper): a latency-bound decode kernel asks L2 for the weights a later kernel of the step will
# stream (the decode attention for the output projection, the MoE gate/up kernel for its experts' down
# projections), so HBM works while the chain waits on small dependent reads. A hint changes no result.
# ``CONVEYOR_L2_HINTS=1`` turns them on (off until a same-machine benchmark shows they pay).
L2_HINT_LANES = tl.constexpr(128) if tl is not None else 128  # bulk prefetches a program issues (one a thread)
_L2_HINTS = os.environ.get("CONVEYOR_L2_HINTS", "0") == "1"


def l2_hints(t) -> bool:
    """Whether kernels on tensor ``t``'s device issue L2 weight hints (``prefetch_l2``)."""
    return _L2_HINTS and t.is_cuda and _pdl_supported(t.device.index or 0)


L2_HINT_MAX_BYTES = 24 << 20  # a hint asks for at most this much of a weight (its first rows): H100/H200 L2 is 50 MB


def hint_span(weight, stand_in) -> tuple:
    """(pointer, bytes) of an L2 hint for ``weight`` (None: no hint, ``stand_in``'s pointer and 0 bytes)."""
    if weight is None:
        return stand_in, 0
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        raise ValueError("an L2 hint needs a contiguous, 16-byte aligned weight")
    return weight, min(weight.numel() * weight.element_size(), L2_HINT_MAX_BYTES) // 16 * 16


if triton is not None:
    @jit
    def prefetch_l2(base, nbytes, part, parts, LANES: tl.constexpr):
        """Part ``part`` of ``parts`` of the ``nbytes`` bytes at ``base`` (16-byte aligned, a multiple of 16) asked
        into L2 with bulk prefetches, ``LANES`` of them (``cp.async.bulk.prefetch.L2``: no registers, no wait)."""
        per_part = tl.cdiv(tl.cdiv(nbytes, parts), 16 * LANES) * (16 * LANES)
        per_lane = per_part // LANES
        lane = tl.arange(0, LANES).to(tl.int64)
        start = part.to(tl.int64) * per_part + lane * per_lane
        size = tl.minimum(tl.maximum(nbytes - start, 0), per_lane).to(tl.int32)
        ptrs = base.to(tl.pointer_type(tl.int8), bitcast=True) + start
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)
else:
    prefetch_l2 = None
