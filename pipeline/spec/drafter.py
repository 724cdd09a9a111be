"""What a drafter is to the decode stage: up to k tokens that may follow a sequence, guessed cheaply. The verify
rows check them (pipeline/stages/decode.py), so a drafter may be wrong but never changes the output.

Two kinds: a host drafter guesses from the tokens alone, one sequence at a time (n-gram lookup); a model drafter
runs a model on the device for every drafting sequence at once (a draft model, MTP, DFlash), after the cache has
given the drafts' positions their KV slots, so the drafter can write its own KV beside the target's in the same
blocks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pipeline.sequence import Sequence
    from pipeline.spec.device_drafts import DeviceDrafts


class Drafter(Protocol):
    name: str
    on_device: bool  # a model drafter: ``plan`` on the host, then ``draft`` on the device thread
    accepts_all: bool  # benchmarks only (pipeline/spec/replay.py): every draft taken, the mechanism's upper bound


class HostDrafter:
    """A drafter that guesses on the host from a sequence's tokens."""

    name = "host"
    on_device = False
    accepts_all = False

    def propose(self, seq: Sequence, k: int) -> list[int]:
        raise NotImplementedError


class ModelDrafter(Protocol):
    name: str
    on_device: bool
    accepts_all: bool

    def plan(self, wanted: list[tuple[Sequence, int]]) -> Any:
        """Host side: the forward inputs that draft ``k`` tokens for each ``(sequence, k)``."""

    def uniform_width(self, plan: Any) -> int | None:
        """The drafts every sequence of the plan gets, when every one gets as many (else None)."""

    def draft(self, plan: Any, into: DeviceDrafts | None = None) -> list[list[int]] | DeviceDrafts:
        """Device thread: run the plan; each sequence's drafts (``into``: promised drafts, as many for every
        sequence, filled on the device and returned; pipeline/spec/device_drafts.py)."""
