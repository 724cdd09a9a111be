"""The compiled stop-string matcher and its pure-Python twin give equal results on random streams
(tests/pipeline/test_stop_strings.py checks the engine's choice against a brute-force model)."""
import importlib
import random

import pytest

from ext import stop_strings_py

try:
    compiled = importlib.import_module("ext.stop_strings")
except ImportError:  # not built
    compiled = None


def run(module, stops, include, chunks):
    matcher = module.StopStringMatcher(stops, include)
    out = []
    for chunk in chunks:
        text, done = matcher.feed(chunk)
        out.append((text, done))
        if done:
            break
    else:
        out.append((matcher.flush(), matcher.matched is not None))
    return out, matcher.matched


@pytest.mark.skipif(compiled is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(200))
def test_compiled_equals_twin(seed):
    rng = random.Random(seed)
    alphabet = "ab\n<>é"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.2:
        stops.append("")
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    include = rng.random() < 0.3
    assert run(compiled, stops, include, chunks) == run(stop_strings_py, stops, include, chunks)


def test_engine_uses_the_compiled_matcher_when_built():
    from pipeline.stop_strings import StopStringMatcher

    expected = compiled.StopStringMatcher if compiled is not None else stop_strings_py.StopStringMatcher
    assert StopStringMatcher is expected
