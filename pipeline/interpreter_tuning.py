"""Process-wide interpreter settings while an engine serves: the cyclic GC and the GIL switch interval.

Both are tuned for the serving shape: one event-loop thread running Python nearly all the time, and
helper threads (the device thread, xgrammar's fill) that release the GIL for
C work and must get it back promptly.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class InterpreterSettings:
    gc_threshold: tuple[int, ...]
    switch_interval_s: float

    @classmethod
    def current(cls) -> InterpreterSettings:
        return cls(gc.get_threshold(), sys.getswitchinterval())

    def apply(self) -> None:
        gc.set_threshold(*self.gc_threshold)
        sys.setswitchinterval(self.switch_interval_s)


def tune_for_serving(gc_young_threshold: int, switch_interval_s: float) -> InterpreterSettings:
    """Apply the serving settings; returns the ones they replace (apply() restores them).

    - What is loaded lives as long as the engine: it is frozen out of the cyclic GC's scans (a 223 ms
      full collection mid-decode, over 700k tracked objects, became 37 ms on the host bench).
    - Young threshold: a step at batch 256 makes and frees a few thousand small objects, so at the
      default 700 the collector ran about twice per step and every tenth young collection cascaded
      into a full one: 15-50 ms pauses, 0.3-0.7 ms/step on average. Per-token objects die by
      reference counting within the step, so a threshold above a step's churn leaves collections to
      real growth (host bench at batch 256: no collection in 250 steps).
    - Switch interval: a thread that released the GIL for C work (a grammar fill, a batch of socket
      sends) waits up to this long for the busy event loop to hand it back. Python's 5 ms is longer
      than a whole decode step; at 1 ms the grammar-constrained batch-256 step went from 4.3-4.7 to
      3.3-3.4 ms on the host bench.
    """
    previous = InterpreterSettings.current()
    gc.collect()
    gc.freeze()
    InterpreterSettings((gc_young_threshold, *previous.gc_threshold[1:]), switch_interval_s).apply()
    return previous


def restore(previous: InterpreterSettings) -> None:
    """Undo tune_for_serving: what it froze can be collected again (engines come and go in one process)."""
    gc.unfreeze()
    previous.apply()
