"""Triton, when installed. CPU-only installs may lack it: kernel modules still import (their torch
references work) and `jit` leaves the kernel functions undecorated; they are never launched there."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:
    triton = tl = None

    def jit(fn):  # type: ignore[no-redef]
        return fn
