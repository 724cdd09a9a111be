"""Ways to split a text into streamed chunks, for the split-invariance tests of the output parsers."""
from __future__ import annotations

import random
from collections.abc import Iterator


def chunkings(text: str, max_cuts: int = 20) -> Iterator[list[str]]:
    """Whole; every two-chunk split; one char at a time; seeded random multi-splits."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(12):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, max_cuts))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
