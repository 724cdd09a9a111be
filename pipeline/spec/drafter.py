"""What a drafter is to the decode stage: up to k tokens that may follow a sequence, guessed cheaply. The verify
rows check them (pipeline/stages/decode.py), so a drafter may be wrong but never changes the output.

Two kinds: a host drafter guesses from the tokens alone, one sequence at a time (n-gram lookup); a model drafter
runs a model on the device for every drafting sequence at once (a draft model, MTP), after the cache has given the
drafts' positions their KV slots, so the drafter can write its own KV beside the target's in the same blocks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pipeline.config import EngineConfig
    from pipeline.sequence import Sequence


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

    def draft(self, plan: Any) -> list[list[int]]:
        """Device thread: run the plan; each sequence's drafts."""


def make_drafter(config: EngineConfig) -> Drafter | None:
    """The configured host drafter (None: no speculation, or a model drafter, which ``load_model`` builds)."""
    if config.speculative_method == "ngram":
        from pipeline.spec.ngram import NgramDrafter

        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    return None
