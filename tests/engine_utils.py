"""Helpers for driving an Engine in tests: start it, collect whole outputs, check for leaks."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.config import EngineConfig
from pipeline.engine import Engine
from pipeline.request import FinishReason, OutputDelta, TokenLogprob


@dataclass
class Sample:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    deltas: list[OutputDelta] = field(default_factory=list)


def config_for(model_dir: Path | str, **overrides: Any) -> EngineConfig:
    # float32 everywhere: results must not depend on whether the CPU has native bf16 ("auto"); the CPU
    # unless a test asks for CUDA.
    # The test's own torch thread count (a module may pin one thread), not the engine's default of every usable core.
    settings: dict[str, Any] = dict(model=str(model_dir), device="cpu", dtype="float32", block_size=4,
                                    num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=256, seed=1234,
                                    cpu_threads=torch.get_num_threads())
    settings.update(overrides)
    return EngineConfig(**settings)


async def collect(engine: Engine, **kwargs: Any) -> list[Sample]:
    samples: dict[int, Sample] = {}
    async for delta in engine.generate(**kwargs):
        sample = samples.setdefault(delta.index, Sample())
        sample.text += delta.text
        sample.token_ids.extend(delta.token_ids)
        sample.deltas.append(delta)
        if delta.logprobs:
            sample.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            assert sample.finish_reason is None, "a sample finished twice"
            sample.finish_reason = delta.finish_reason
    return [samples[i] for i in sorted(samples)]


async def settle(engine: Engine, timeout_s: float = 60.0) -> None:
    """Wait until every stage is idle: a sequence ended by a stop string is released at its owner's
    next step, which may still be running on the device thread. Polls the condition; the deadline
    only turns a hang into a failure."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["running"] == 0 and stats["prefilling"] == 0 and stats["decode_in_flight"] == 0 and all(
                s["inbox_depth"] == 0 for s in stats["stages"].values()):
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"engine did not settle: {engine.stats()}")


def assert_no_leaks(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["kv_blocks"]["used"] == 0, stats
    assert stats["seats"]["held"] == 0, stats
    assert stats["state_slots_used"] == 0, stats
    assert stats["waiting"] == {"requests": 0, "tokens": 0}, stats
    assert engine.detokenize.samples == {}, "detokenizer state leaked"
