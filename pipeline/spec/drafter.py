"""What a drafter is to the decode stage: up to k tokens that may follow a sequence, guessed cheaply. The verify
rows check them (pipeline/stages/decode.py), so a drafter may be wrong but never changes the output."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pipeline.config import EngineConfig
    from pipeline.sequence import Sequence


class Drafter(Protocol):
    name: str

    def propose(self, seq: Sequence, k: int) -> list[int]: ...


def make_drafter(config: EngineConfig) -> Drafter | None:
    """The configured drafter (None: no speculation)."""
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        from pipeline.spec.ngram import NgramDrafter

        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"unknown speculative_method {config.speculative_method!r}")
