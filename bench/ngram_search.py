"""The n-gram drafter's search per call, compiled against its pure-Python twin, on histories of agent-like length
(a repeated file quoted back, random tokens elsewhere). JSON out; asserts nothing.

    python3 bench/ngram_search.py --out $OUT/ngram-search.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def history(length: int, seed: int) -> np.ndarray:
    """Random tokens with a 'file' (an eighth of the history, at most 400 tokens) quoted twice in them, the history
    ending halfway into a third quote (where drafts are found)."""
    rng = random.Random(seed)
    size = min(400, length // 8)
    file = [rng.randrange(100, 150000) for _ in range(size)]
    filler = length - 2 * size - size // 2
    cuts = sorted(rng.sample(range(filler), 2))
    noise = [rng.randrange(100, 150000) for _ in range(filler)]
    tokens = noise[:cuts[0]] + file + noise[cuts[0]:cuts[1]] + file + noise[cuts[1]:] + file[:size // 2]
    return np.array(tokens, dtype=np.int64)


def per_call_us(module, tokens: np.ndarray, k: int, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        module.propose(tokens, len(tokens), k, 2, 4)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ngram-search.json"))
    a = ap.parse_args()
    modules = {"twin": importlib.import_module("ext.ngram_py")}
    try:
        modules["compiled"] = importlib.import_module("ext.ngram")
    except ImportError:
        pass
    rows = []
    for length in (1024, 8192, 32768):
        tokens = history(length, length)
        for name, module in modules.items():
            calls = 200 if name == "compiled" else max(3, 20000 // length)
            rows.append({"history": length, "module": name, "us_per_call": per_call_us(module, tokens, 7, calls),
                         "drafts": len(module.propose(tokens, len(tokens), 7, 2, 4))})
            print(json.dumps(rows[-1]))
    with open(a.out, "w") as handle:
        json.dump({"rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
