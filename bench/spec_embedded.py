"""n-gram speculation on the embedded model (SmolLM2-135M, CPU): agent-like requests that quote what they edit,
plain decoding against drafts of K tokens, each request alone. Output tokens must be equal; reports decode tok/s,
the speedup and the drafts' acceptance. Prints JSON; asserts nothing.

    .venv/bin/python bench/spec_embedded.py [--k 5] [--new-tokens 160] [--out results/x.json]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.config import EngineConfig  # noqa: E402
from pipeline.embedded import embedded_model_path  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.request import SamplingParams  # noqa: E402
from report import emit_json  # noqa: E402  (bench/ is on sys.path when run as a script)

CODE = """def merge_sorted(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    out.extend(a[i:]); out.extend(b[j:])
    return out
"""
CONFIG = '{"name": "conveyor", "port": 8000, "workers": 4, "log_level": "info", "cache": {"size_mb": 512}}'
REQUESTS = [
    "Rename the function merge_sorted to merge_lists and return the whole code unchanged otherwise:\n\n" + CODE,
    "Add a docstring to this function and return the whole function:\n\n" + CODE,
    "Change the port to 9000 and return the whole JSON:\n\n" + CONFIG,
    "Explain what a hash map is.",  # nothing to quote: drafts rarely found
]


async def run(k: int, new_tokens: int, dtype: str) -> list[dict]:
    extra = dict(speculative_method="ngram", num_speculative_tokens=k) if k else {}
    engine = await Engine.create(EngineConfig(model=embedded_model_path(), device="cpu", dtype=dtype, **extra))
    try:
        out = []
        for text in REQUESTS:
            stamps, ids = [], []
            async for delta in engine.generate(messages=[{"role": "user", "content": text}],
                                               params=SamplingParams(max_tokens=new_tokens, temperature=0.0)):
                stamps.append(time.perf_counter())
                ids += delta.token_ids
            out.append({"ids": ids, "decode_s": stamps[-1] - stamps[0]})
        out.append({"speculation": engine.stats()["speculation"]})
        return out
    finally:
        await engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    plain, spec = asyncio.run(run(0, a.new_tokens, a.dtype)), asyncio.run(run(a.k, a.new_tokens, a.dtype))
    rows = []
    for text, p, s in zip(REQUESTS, plain, spec):
        rate = lambda r: (len(r["ids"]) - 1) / r["decode_s"]  # noqa: E731
        rows.append({"request": text[:40], "tokens": len(p["ids"]), "equal": p["ids"] == s["ids"],
                     "plain_tok_s": rate(p), "spec_tok_s": rate(s), "speedup": rate(s) / rate(p)})
    emit_json({"k": a.k, "new_tokens": a.new_tokens, "dtype": a.dtype, "rows": rows,
               "speculation": spec[-1]["speculation"]}, a.out)


if __name__ == "__main__":
    main()
