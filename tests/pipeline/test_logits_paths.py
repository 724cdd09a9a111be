"""Every path that picks a token goes through the one logits pipeline: the first token after
prefill (alone and in a merged prefill+decode step), every decode step, run ahead or not."""
from __future__ import annotations

import asyncio

import pytest

from pipeline.engine import Engine
from pipeline.request import SamplingParams
from pipeline.runner import sampler
from tests.conftest import run_async
from tests.engine_utils import collect, config_for


@pytest.mark.parametrize("run_ahead", [True, False])
def test_prefill_and_decode_tokens_all_pass_through_the_pipeline(tiny_model_dir, monkeypatch, run_ahead):
    seen_rows: list[int] = []
    real = sampler.apply_logits_pipeline

    def spy(logits, batch):
        seen_rows.append(batch.num_rows)
        return real(logits, batch)

    monkeypatch.setattr(sampler, "apply_logits_pipeline", spy)

    async def main():
        engine = await Engine.create(config_for(tiny_model_dir, run_ahead=run_ahead))
        try:
            # logit_bias only exists inside the pipeline: a token it forces proves the row went through it
            forced = SamplingParams(max_tokens=6, temperature=0.7, seed=2, ignore_eos=True, logit_bias={777: 100.0})
            plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            results = await asyncio.gather(collect(engine, prompt_token_ids=[5, 6, 7], params=forced),
                                           collect(engine, prompt_token_ids=[9] * 20, params=plain),
                                           collect(engine, prompt_token_ids=[8, 9], params=forced))
            return results, engine.stats()["device_steps"]
        finally:
            await engine.shutdown()

    (first, _, third), steps = run_async(main())
    assert first[0].token_ids == [777] * 6 and third[0].token_ids == [777] * 6
    assert len(seen_rows) == steps  # one pipeline call per device step, none bypassed
    assert sum(seen_rows) == 3 * 6  # every sampled token of every request
