"""Host time per decode step with a null device: the step itself costs nothing, so what is timed is
everything the host does per token (scheduling, step inputs, sampling rows, detokenization, the
output channels and, with --http, SSE writes to real clients).

The embedded SmolLM2 model is loaded for its tokenizer and limits; the executor is then bound to a
null launch that "samples" a pseudo-random token per row with no math.

    python bench/host_overhead.py --batch 1 32 256 [--http] [--out bench/results/host.json]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import emit_json  # noqa: E402
from pipeline.config import EngineConfig  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.request import SamplingParams  # noqa: E402
from pipeline.runner.sampler import SamplerOutput  # noqa: E402
from pipeline.runner.step_plan import StepPlan  # noqa: E402


class NullSample:
    """A step's "results": token ids from a cheap hash of each row's position; always ready."""

    def __init__(self, token_ids: np.ndarray) -> None:
        self.token_ids = torch.from_numpy(token_ids)
        self._output = SamplerOutput(token_ids, None, None, None)

    def is_ready(self) -> bool:
        return True

    def to_host(self) -> SamplerOutput:
        return self._output


def null_launch(vocab: int):
    def launch(plan: StepPlan, previous_tokens) -> NullSample:
        ids = [((c.start_pos + len(c.token_ids)) * 2654435761 + i * 97) % (vocab - 300) + 256
               for c in plan.chunks for i, _ in enumerate(c.rows)]
        return NullSample(np.asarray(ids, dtype=np.int64))

    return launch


async def engine_run(engine: Engine, batch: int, tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    firsts: list[float] = []

    async def one(i: int) -> None:
        first = True
        async for _ in engine.generate(prompt_token_ids=[300 + i, 400 + i, 500], params=params):
            if first:
                firsts.append(time.perf_counter())
                first = False

    before = engine.stats()["device_steps"]
    await asyncio.gather(*(one(i) for i in range(batch)))
    end = time.perf_counter()
    steps = engine.stats()["device_steps"] - before
    decode_s = end - max(firsts)  # every sequence decoding: the steady state
    return {"batch": batch, "tokens": tokens, "device_steps": steps,
            "ms_per_step": decode_s / (tokens - 1) * 1e3, "wall_s": end - min(firsts)}


async def main_async(a: argparse.Namespace) -> dict:
    engine = await Engine.create(EngineConfig(model=a.model, load_format="dummy" if a.model else "auto",
                                              max_num_seqs=max(a.batch), run_ahead=not a.disable_run_ahead,
                                              num_kv_blocks=max(a.batch) * (a.tokens // 16 + 4) + 16))
    engine.executor.bind(null_launch(engine.loaded.limits.vocab_size))
    results = []
    try:
        for batch in a.batch:
            await engine_run(engine, min(batch, 8), 8)  # warm-up
            profiler = cProfile.Profile() if a.profile else None
            if profiler:
                profiler.enable()
            results.append(await engine_run(engine, batch, a.tokens))
            if profiler:
                profiler.disable()
                stats = pstats.Stats(profiler).sort_stats("tottime")
                print(f"--- batch {batch}", file=sys.stderr)
                stats.stream = sys.stderr
                stats.print_stats(25)
            print(f"batch {batch}: {results[-1]['ms_per_step']:.3f} ms/step", file=sys.stderr)
    finally:
        await engine.shutdown()
    return {"benchmark": "host_overhead", "path": "engine.generate", "run_ahead": not a.disable_run_ahead,
            "results": results}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="a model dir for its tokenizer (dummy weights); default: embedded")
    parser.add_argument("--disable-run-ahead", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile each batch (stderr)")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    emit_json(asyncio.run(main_async(a)), a.out)


if __name__ == "__main__":
    main()
