"""Exact speculation in the runner: which steps compute their rows as one-token decode rows
(``kernels.dispatch.rows_as_decode``)."""

from __future__ import annotations

import asyncio

import pytest

from kernels import dispatch
from pipeline.spec.replay import ReplayDrafter
from tests.conftest import run_async
from tests.pipeline.spec.test_engine_speculation import SPEC, greedy, prompts, run


def test_exact_speculation_turns_it_on_for_the_runner(tiny_model_dir):
    from pipeline.engine import Engine
    from tests.engine_utils import config_for

    async def flag(**overrides) -> bool:
        engine = await Engine.create(config_for(tiny_model_dir, **overrides))
        try:
            return engine.loaded.runner.rows_as_decode
        finally:
            await engine.shutdown()

    spec = dict(speculative_method="ngram", num_speculative_tokens=3)
    assert not asyncio.run(flag()) and not asyncio.run(flag(**spec))
    assert asyncio.run(flag(**spec, exact_speculation=True))


def test_only_one_sequence_steps_take_it(tiny_model_dir, monkeypatch):
    """Exact speculation covers a batch of one sequence (larger batches' plain rows are multi-row anyway): the
    runner turns the switch on for a one-sequence step of up to 16 tokens and for nothing else."""
    from pipeline.engine import Engine
    from pipeline.request import SamplingParams
    from tests.engine_utils import collect, config_for

    seen: list[tuple[int, int, bool]] = []
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        engine = await Engine.create(config_for(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=3,
                                                exact_speculation=True))
        runner = engine.loaded.runner
        forward = runner.model.forward

        def recording(ids, positions, ctx):
            seen.append((ctx.attention.num_seqs, ids.shape[0], dispatch.decode_rows_on()))
            return forward(ids, positions, ctx)

        monkeypatch.setattr(runner.model, "forward", recording)
        try:
            await asyncio.gather(*[collect(engine, prompt_token_ids=[5, 6, 7, 5, 6, 7, 5, 6][:4 + i],
                                           params=greedy) for i in range(2)])
            await collect(engine, prompt_token_ids=[9, 8, 9, 8, 9, 8, 9], params=greedy)
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert any(on for _, _, on in seen) and any(seqs > 1 for seqs, _, _ in seen)
    assert all(on == (seqs == 1 and tokens <= 16) for seqs, tokens, on in seen)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama", "qwen3_moe", "qwen3_5_moe_text"])
def test_gpu_bf16_verify_rows_keep_plain_decoding_bits(tiny_model_dir, make_model_dir, model):
    """bf16 on CUDA, one sequence, ``exact_speculation``: drafts replaying plain decoding's tokens are all accepted
    and the output is plain decoding's, token for token, because each verify token is computed as a one-token
    decode row (kernels/dispatch.py rows_as_decode)."""
    if model != "llama":
        tiny_model_dir = make_model_dir(model, seed=5)
    batch, params = prompts(1), [greedy(200)]
    plain, _ = run_async(run(tiny_model_dir, batch, params, device="cuda", dtype="bfloat16"))
    drafter = ReplayDrafter({tuple(batch[0]): plain[0][0]}, 0.0)
    spec, stats = run_async(run(tiny_model_dir, batch, params, drafter, device="cuda", dtype="bfloat16",
                                exact_speculation=True, **SPEC))
    assert spec == plain
    assert stats["speculation"]["accepted_tokens"] == stats["speculation"]["drafted_tokens"] > 100
