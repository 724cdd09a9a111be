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
``CONVEYOR_PDL=0`` (``envs.PDL``) turns it off; it is read once per device, at the device's first launch.

Early reads: a decode kernel whose inputs are mostly state from earlier steps reads that state before its wait,
overlapping the kernels it waits on: the decode attention its cached keys (all but the step's own key), the Gated
DeltaNet recurrence and conv their state slots, the MoE down kernel the routing (its gate/up kernel launches it only
after its own wait, ``LATE_TRIGGER``) and its first weight tile. The rule that makes this safe: nothing a kernel
reads before its wait may be written by a kernel of the same step before it, except by a kernel that has finished
by the time this one launches. Slots, block tables and lengths are host copies made before the step's kernels, and
each layer's state is written only by that layer's own kernel."""
from __future__ import annotations

import functools
import os

import envs

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

    return (gdc_wait is not None and not INTERPRET and envs.PDL.get()
            and torch.cuda.get_device_capability(device_index)[0] >= 9)


def pdl_launch(t) -> dict[str, bool]:
    """Launch keywords for a kernel with a ``PDL`` constexpr, for tensor ``t``'s device: ``{}`` (PDL off: the
    kernel's default ``PDL=False`` and an ordinary launch) unless the device supports dependent launch."""
    if not t.is_cuda or not _pdl_supported(t.device.index or 0):
        return {}
    return {"PDL": True, "launch_pdl": True}


@jit
def pdl_wait(PDL: tl.constexpr, LATE_TRIGGER: tl.constexpr = False):
    """With ``PDL``: let the next kernel launch, then wait for the kernel before this one to finish (its outputs
    are readable after this). A no-op without it. ``LATE_TRIGGER``: the next kernel launches only once this wait
    is over, so before its own wait it may read what the kernel before this one wrote."""
    if PDL:
        if LATE_TRIGGER:
            gdc_wait()
            gdc_launch_dependents()
        else:
            gdc_launch_dependents()
            gdc_wait()
