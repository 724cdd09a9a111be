"""Triton, when installed. CPU-only installs may lack it: kernel modules still import (their torch
references work) and `jit` leaves the kernel functions undecorated; they are never launched there.

`jit(do_not_specialize=[...])` names integer arguments that change from step to step (sequence counts, block
table widths, slot counts): Triton otherwise compiles a variant per value class (1, a multiple of 16, other),
and a serving step that first meets a new class waits a second for the compiler."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:
    triton = tl = None

    def jit(fn=None, **_options):  # type: ignore[no-redef]
        return fn if fn is not None else (lambda f: f)
