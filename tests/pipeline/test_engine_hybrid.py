"""The whole stage graph on a tiny random Qwen3.5-MoE (Gated DeltaNet + gated attention + MoE): greedy output
equals transformers, batches and chunked prefill change no tokens, and every end path (finish, cancel,
disconnect, preemption) returns the sequence's recurrent state slot with its blocks."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from pipeline.engine import Engine
from pipeline.request import FinishReason, SamplingParams
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def hybrid_dir(make_model_dir):
    return make_model_dir("qwen3_5_moe_text", seed=5)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


async def run_all(engine: Engine, prompt_list, params) -> list[list[int]]:
    results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=params) for p in prompt_list])
    return [r[0].token_ids for r in results]


def test_alone_batched_and_chunked_equal_transformers(hybrid_dir):
    from transformers import AutoModelForCausalLM

    batch = prompts(5, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                    for p in batch]

    async def main():
        results = []
        for budget in (256, 7):  # whole prompts, then chunks of at most 7 tokens beside decode rows
            engine = await Engine.create(config_for(hybrid_dir, max_num_batched_tokens=budget))
            try:
                alone = [(await collect(engine, prompt_token_ids=p, params=greedy()))[0].token_ids for p in batch]
                together = await run_all(engine, batch, greedy())
                await settle(engine)
                assert_no_leaks(engine)
                results.append((alone, together))
            finally:
                await engine.shutdown()
        return results

    for alone, together in run_async(main()):
        assert alone == expected
        assert together == expected


def test_preemption_recomputes_the_state(hybrid_dir):
    async def main():
        roomy = await Engine.create(config_for(hybrid_dir))
        try:
            expected = await run_all(roomy, prompts(6, seed=5), greedy(20))
        finally:
            await roomy.shutdown()
        tight = await Engine.create(config_for(hybrid_dir, num_kv_blocks=20, max_num_batched_tokens=16))
        try:
            got = await run_all(tight, prompts(6, seed=5), greedy(20))
            await settle(tight)
            assert_no_leaks(tight)
            return expected, got, tight.stats()["preemptions"]
        finally:
            await tight.shutdown()

    expected, got, preemptions = run_async(main())
    assert preemptions > 0
    assert got == expected


def test_cancel_and_disconnect_free_the_slot(hybrid_dir):
    async def main():
        engine = await Engine.create(config_for(hybrid_dir))
        try:
            seen = 0
            finish = None
            async for delta in engine.generate(prompt_token_ids=prompts(1)[0], params=greedy(400), request_id="v"):
                seen += 1
                if seen == 3:
                    assert engine.stats()["state_slots_used"] == 1
                    engine.abort("v")
                finish = delta.finish_reason or finish
            await settle(engine)
            assert_no_leaks(engine)
            stream = engine.generate(prompt_token_ids=prompts(1, seed=2)[0], params=greedy(400))
            await stream.__anext__()
            await stream.aclose()  # a disconnected client
            await settle(engine)
            assert_no_leaks(engine)
            return finish
        finally:
            await engine.shutdown()

    assert run_async(main()) is FinishReason.ABORT


def test_64_concurrent_requests_leave_every_pool_empty(hybrid_dir):
    async def main():
        engine = await Engine.create(config_for(hybrid_dir, num_kv_blocks=200, max_num_seqs=16))
        try:
            rng = random.Random(7)
            params = [SamplingParams(max_tokens=rng.randint(1, 16), temperature=rng.choice([0.0, 0.8]),
                                     ignore_eos=True, n=rng.choice([1, 1, 2])) for _ in range(64)]
            results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=sp)
                                             for p, sp in zip(prompts(64, seed=9), params)])
            await settle(engine)
            assert_no_leaks(engine)
            return [[(len(s.token_ids), s.finish_reason) for s in r] for r in results], params
        finally:
            await engine.shutdown()

    results, params = run_async(main())
    for samples, sp in zip(results, params):
        assert samples == [(sp.max_tokens, FinishReason.LENGTH)] * sp.n


def test_greedy_siblings_recompute_the_prompt_and_agree(hybrid_dir):
    async def main():
        engine = await Engine.create(config_for(hybrid_dir))
        try:
            prompt = prompts(1, seed=4)[0]
            one = (await collect(engine, prompt_token_ids=prompt, params=greedy()))[0].token_ids
            many = await collect(engine, prompt_token_ids=prompt, params=greedy(n=3))
            await settle(engine)
            assert_no_leaks(engine)
            return one, [s.token_ids for s in many]
        finally:
            await engine.shutdown()

    one, many = run_async(main())
    assert many == [one] * 3
