"""The loop guard's repetition detector: compiled == twin == a brute-force definition."""
import random

import pytest

from tests.ext.twins import twin_and_compiled

MODULES = twin_and_compiled("repetition")


def brute_force(tokens: list[int], min_size: int, max_size: int, min_count: int) -> bool:
    """Does `tokens` end in some pattern of min_size..max_size tokens repeated min_count times?"""
    for size in range(min_size, max_size + 1):
        span = size * min_count
        if len(tokens) >= span:
            tail = tokens[-span:]
            if all(tail[i] == tail[i - size] for i in range(size, span)):
                return True
    return False


def first_trigger(module, tokens, *args) -> int | None:
    detector = module.RepetitionDetector(*args)
    return next((i for i, t in enumerate(tokens) if detector.feed(t)), None)


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("seed", range(30))
def test_detector_fires_exactly_when_brute_force_says(module, seed):
    rng = random.Random(seed)
    args = (rng.randint(1, 3), rng.randint(3, 8), rng.randint(2, 5))
    tokens: list[int] = []
    for _ in range(rng.randint(2, 8)):  # random text and repeated stretches
        if rng.random() < 0.5:
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 12))]
        else:
            pattern = [rng.randrange(6) for _ in range(rng.randint(1, 8))]
            tokens += pattern * rng.randint(1, 6)
    expected = next((i for i in range(len(tokens)) if brute_force(tokens[: i + 1], *args)), None)
    assert first_trigger(module, tokens, *args) == expected


@pytest.mark.parametrize("module", MODULES)
def test_a_degenerate_loop_is_caught_and_varied_text_is_not(module):
    loop = [11, 12, 13, 14] * 10
    assert first_trigger(module, [1, 2, 3] + loop, 2, 8, 4) == 3 + 4 * 4 - 1
    assert first_trigger(module, list(range(500)), 1, 64, 2) is None
    detector = module.RepetitionDetector(2, 8, 4)
    for token in [1, 2, 3] + loop:
        if detector.feed(token):
            break
    assert detector.pattern_size == 4


@pytest.mark.parametrize("module", MODULES)
def test_bad_settings_are_refused(module):
    with pytest.raises(ValueError):
        module.RepetitionDetector(3, 2, 4)
    with pytest.raises(ValueError):
        module.RepetitionDetector(1, 4, 1)
