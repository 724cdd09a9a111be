"""The whole stage graph on a tiny random Llama: batching, chunking, preemption, cancellation, seeds."""
from __future__ import annotations

import asyncio
import random

import pytest

from pipeline.engine import Engine
from pipeline.errors import AdmissionRefused, InvalidRequest
from pipeline.request import FinishReason, SamplingParams
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


async def run_all(engine: Engine, prompt_list, params) -> list[list[int]]:
    results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=params) for p in prompt_list])
    return [r[0].token_ids for r in results]


async def alone_then_batched(model_dir, **overrides):
    engine = await Engine.create(config_for(model_dir, **overrides))
    try:
        batch = prompts(8)
        alone = [(await collect(engine, prompt_token_ids=p, params=greedy()))[0].token_ids for p in batch]
        together = await run_all(engine, batch, greedy())
        await settle(engine)
        assert_no_leaks(engine)
        return alone, together, engine.stats()
    finally:
        await engine.shutdown()


def test_batch_of_8_equals_each_alone(tiny_model_dir):
    alone, together, stats = run_async(alone_then_batched(tiny_model_dir))
    assert together == alone
    assert all(len(t) == 16 for t in alone)


def test_chunked_prefill_equals_unchunked(tiny_model_dir):
    async def main():
        results = []
        for budget in (512, 5):
            engine = await Engine.create(config_for(tiny_model_dir, max_num_batched_tokens=budget))
            try:
                results.append(await run_all(engine, prompts(6, seed=3), greedy()))
            finally:
                await engine.shutdown()
        return results

    unchunked, chunked = run_async(main())
    assert chunked == unchunked


def test_preemption_with_a_tiny_pool_recomputes_the_same_tokens(tiny_model_dir):
    async def main():
        roomy = await Engine.create(config_for(tiny_model_dir))
        try:
            expected = await run_all(roomy, prompts(8, seed=5), greedy(24))
        finally:
            await roomy.shutdown()
        # 24 usable blocks of 4 tokens: one sequence (<= 64 tokens) fits, eight do not.
        tight = await Engine.create(config_for(tiny_model_dir, num_kv_blocks=25, max_num_batched_tokens=16))
        try:
            got = await run_all(tight, prompts(8, seed=5), greedy(24))
            await settle(tight)
            assert_no_leaks(tight)
            return expected, got, tight.stats()["preemptions"]
        finally:
            await tight.shutdown()

    expected, got, preemptions = run_async(main())
    assert preemptions > 0
    assert got == expected


def test_preempting_sequences_that_share_a_cached_prefix_block(tiny_model_dir):
    """Prompts sharing their first blocks through the prefix cache, in a pool too small for all of them: a victim
    gives back only the blocks it holds alone (a shared block stays), so the planner must not count the shared ones
    as freed; it did, and the step it planned then failed to allocate and stopped the engine."""
    shared = prompts(1, seed=9)[0][:12] + [7, 7, 7, 7]  # three full blocks of 4 every prompt starts with
    batch = [shared + p[:6] for p in prompts(8, seed=6)]

    async def main():
        roomy = await Engine.create(config_for(tiny_model_dir))
        try:
            expected = await run_all(roomy, batch, greedy(40))
        finally:
            await roomy.shutdown()
        tight = await Engine.create(config_for(tiny_model_dir, num_kv_blocks=48, max_num_batched_tokens=32))
        try:
            got = await run_all(tight, batch, greedy(40))
            await settle(tight)
            assert_no_leaks(tight)
            return expected, got, tight.stats()["preemptions"], tight.health()
        finally:
            await tight.shutdown()

    expected, got, preemptions, health = run_async(main())
    assert health is None and preemptions > 0
    assert got == expected


def test_cancel_mid_generation_frees_every_block(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            finish = None
            seen = 0
            async for delta in engine.generate(prompt_token_ids=prompts(1)[0], params=greedy(400),
                                               request_id="victim"):
                seen += 1
                if seen == 3:
                    assert engine.stats()["kv_blocks"]["used"] > 0
                    engine.abort("victim")
                finish = delta.finish_reason or finish
            await settle(engine)
            assert_no_leaks(engine)
            return finish, seen
        finally:
            await engine.shutdown()

    finish, seen = run_async(main())
    assert finish is FinishReason.ABORT
    assert seen < 20  # stopped within a step or two, not at max_tokens


def test_closing_the_stream_early_cancels_the_request(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            stream = engine.generate(prompt_token_ids=prompts(1)[0], params=greedy(400))
            await stream.__anext__()
            await stream.aclose()  # what a disconnected client does
            await settle(engine)
            assert_no_leaks(engine)
        finally:
            await engine.shutdown()

    run_async(main())


def test_64_concurrent_requests_leave_the_pool_empty(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir, num_kv_blocks=200, max_num_seqs=32))
        try:
            rng = random.Random(7)
            params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.8]),
                                     ignore_eos=True) for _ in range(64)]
            results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=sp)
                                             for p, sp in zip(prompts(64, seed=9), params)])
            await settle(engine)
            assert_no_leaks(engine)
            return [(len(r[0].token_ids), sp.max_tokens, r[0].finish_reason) for r, sp in zip(results, params)]
        finally:
            await engine.shutdown()

    for produced, wanted, finish in run_async(main()):
        assert produced == wanted and finish is FinishReason.LENGTH


def test_same_seed_same_output_alone_or_batched(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
            target = prompts(1, seed=11)[0]
            alone = (await collect(engine, prompt_token_ids=target, params=seeded))[0].token_ids
            noise = [collect(engine, prompt_token_ids=p, params=SamplingParams(max_tokens=15, temperature=1.0))
                     for p in prompts(7, seed=12)]
            batched = await asyncio.gather(collect(engine, prompt_token_ids=target, params=seeded), *noise)
            other_seed = await collect(engine, prompt_token_ids=target,
                                       params=SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=43,
                                                             ignore_eos=True))
            return alone, batched[0][0].token_ids, other_seed[0].token_ids
        finally:
            await engine.shutdown()

    alone, batched, other = run_async(main())
    assert alone == batched
    assert alone != other


def test_n_samples_share_the_prompt_and_sample_zero_matches_n1(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            prompt = prompts(1, seed=21)[0] * 2  # > one block, with a partial tail
            params = dict(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
            single = await collect(engine, prompt_token_ids=prompt, params=SamplingParams(**params))
            many = await collect(engine, prompt_token_ids=prompt, params=SamplingParams(n=3, **params))
            await settle(engine)
            assert_no_leaks(engine)
            return single, many
        finally:
            await engine.shutdown()

    single, many = run_async(main())
    assert len(many) == 3 and all(len(s.token_ids) == 12 for s in many)
    assert many[0].token_ids == single[0].token_ids
    assert many[1].token_ids != many[0].token_ids and many[2].token_ids != many[1].token_ids


def test_greedy_n_samples_with_forked_blocks_agree(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            return await collect(engine, prompt_token_ids=prompts(1, seed=4)[0] * 3, params=greedy(10, n=2))
        finally:
            await engine.shutdown()

    first, second = run_async(main())
    assert first.token_ids == second.token_ids  # the sibling recomputed the partial tail correctly


def test_stop_strings_never_reach_the_output(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            prompt = prompts(1, seed=31)[0]
            full = (await collect(engine, prompt_token_ids=prompt, params=greedy(40)))[0]
            stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
            stopped = (await collect(engine, prompt_token_ids=prompt, params=greedy(40, stop=[stop])))[0]
            await settle(engine)
            assert_no_leaks(engine)
            return full, stop, stopped
        finally:
            await engine.shutdown()

    full, stop, stopped = run_async(main())
    assert stop and stop in full.text
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == full.text[: full.text.index(stop)]
    emitted = ""
    for delta in stopped.deltas:
        emitted += delta.text
        assert stop not in emitted


def test_eos_min_tokens_and_ignore_eos(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            prompt = prompts(1, seed=41)[0]
            force_eos = {2: 100.0}
            eos = await collect(engine, prompt_token_ids=prompt,
                                params=SamplingParams(max_tokens=10, temperature=0.0, logit_bias=force_eos))
            held = await collect(engine, prompt_token_ids=prompt,
                                 params=SamplingParams(max_tokens=10, min_tokens=4, temperature=0.0,
                                                       logit_bias=force_eos))
            ignored = await collect(engine, prompt_token_ids=prompt,
                                    params=SamplingParams(max_tokens=5, temperature=0.0, logit_bias=force_eos,
                                                          ignore_eos=True))
            return eos[0], held[0], ignored[0]
        finally:
            await engine.shutdown()

    eos, held, ignored = run_async(main())
    assert eos.token_ids == [2] and eos.finish_reason is FinishReason.STOP
    assert len(held.token_ids) == 5 and held.token_ids[-1] == 2 and 2 not in held.token_ids[:4]
    assert ignored.token_ids == [2] * 5 and ignored.finish_reason is FinishReason.LENGTH


def test_logprobs_report_the_sampled_token_and_alternatives(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            return (await collect(engine, prompt_token_ids=prompts(1)[0], params=greedy(6, logprobs=3)))[0]
        finally:
            await engine.shutdown()

    sample = run_async(main())
    assert len(sample.logprobs) == 6
    for token, entry in zip(sample.token_ids, sample.logprobs):
        assert entry.token_id == token and len(entry.top) == 3
        assert entry.top[0][0] == token and entry.top[0][1] == pytest.approx(entry.logprob)
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


def test_invalid_requests_and_admission_limits_fail_cleanly(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir, max_model_len=64, max_waiting_requests=1))
        try:
            errors = []
            for kwargs in (dict(prompt_token_ids=[]), dict(prompt_token_ids=[10**9]),
                           dict(prompt_token_ids=[5] * 64),
                           dict(prompt_token_ids=[5] * 10, params=SamplingParams(max_tokens=60)),
                           dict(prompt_token_ids=[5], params=SamplingParams(temperature=-1)),
                           dict(prompt_token_ids=[5], params=SamplingParams(logit_bias={-3: 1.0})),
                           dict(messages=[])):
                with pytest.raises(InvalidRequest) as info:
                    await collect(engine, **kwargs)
                errors.append(str(info.value))
            # one long request occupies the only waiting slot while the engine is busy with it
            first = asyncio.ensure_future(collect(engine, prompt_token_ids=[5] * 8, params=greedy(30)))
            second = asyncio.ensure_future(collect(engine, prompt_token_ids=[6] * 8, params=greedy(30)))
            outcomes = await asyncio.gather(first, second, return_exceptions=True)
            await settle(engine)
            assert_no_leaks(engine)
            return errors, outcomes
        finally:
            await engine.shutdown()

    errors, outcomes = run_async(main())
    assert "64" in errors[2] and "70" in errors[3]  # the numbers are in the messages
    refused = [o for o in outcomes if isinstance(o, AdmissionRefused)]
    served = [o for o in outcomes if isinstance(o, list)]
    assert len(served) >= 1 and len(refused) + len(served) == 2


def test_chat_messages_use_the_template(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            out = await collect(engine, messages=[{"role": "user", "content": "hi"}], params=greedy(4))
            ids = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                          add_special_tokens=False)
            direct = await collect(engine, prompt_token_ids=ids, params=greedy(4))
            return out[0].token_ids, direct[0].token_ids
        finally:
            await engine.shutdown()

    via_chat, direct = run_async(main())
    assert via_chat == direct


def test_a_reader_that_stops_reading_is_aborted_alone(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir, output_channel_cap_bytes=64))
        try:
            stalled = engine.generate(prompt_token_ids=prompts(1, seed=51)[0], params=greedy(300))
            await stalled.__anext__()  # then never read again until the others are done
            others = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=greedy(12))
                                            for p in prompts(4, seed=52)])
            await settle(engine)
            tail = [d async for d in stalled]
            await settle(engine)
            assert_no_leaks(engine)
            return others, tail
        finally:
            await engine.shutdown()

    others, tail = run_async(main())
    assert all(len(o[0].token_ids) == 12 for o in others)
    assert tail[-1].finish_reason is FinishReason.ERROR and "output buffer" in tail[-1].error
    assert sum(len(d.token_ids) for d in tail) < 299  # it was stopped, not run to max_tokens


def test_a_prompt_arriving_while_others_decode_joins_their_steps_and_changes_no_tokens(tiny_model_dir):
    """The step planner puts a new prompt's chunks into decode's next step (a mixed step); the tokens
    of every request equal those it gets alone."""

    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            first, second = prompts(2, seed=77)
            expected = [(await collect(engine, prompt_token_ids=p, params=greedy(30)))[0].token_ids
                        for p in (first, second)]
            steps_before = engine.stats()["mixed_steps"]
            stream = engine.generate(prompt_token_ids=first, params=greedy(30))
            tokens = [(await stream.__anext__()).token_ids]
            joined = asyncio.ensure_future(collect(engine, prompt_token_ids=second, params=greedy(30)))
            tokens += [delta.token_ids async for delta in stream]
            got = [[t for ids in tokens for t in ids], (await joined)[0].token_ids]
            assert got == expected
            assert engine.stats()["mixed_steps"] > steps_before
            await settle(engine)
            assert_no_leaks(engine)
        finally:
            await engine.shutdown()

    run_async(main())
