"""Decode one step ahead gives exactly the tokens, logprobs and finishes of step-by-step decode,
including sequences that end at a step whose successor was already launched, preemption, and
requests that must wait for their previous token (penalties, min_tokens)."""
from __future__ import annotations

import asyncio
import random

import pytest

from pipeline.engine import Engine
from pipeline.request import SamplingParams
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(3, 30))] for _ in range(count)]


async def generate_all(model_dir, run_ahead: bool, requests: list[tuple[list[int], SamplingParams]],
                       **overrides) -> tuple[list, dict]:
    engine = await Engine.create(config_for(model_dir, run_ahead=run_ahead, **overrides))
    try:
        results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=sp) for p, sp in requests])
        await settle(engine)
        assert_no_leaks(engine)
        summary = [[(s.token_ids, s.finish_reason, [(lp.token_id, lp.logprob) for lp in s.logprobs])
                    for s in samples] for samples in results]
        return summary, engine.stats()
    finally:
        await engine.shutdown()


def assert_same(first: list, second: list) -> None:
    """Identical tokens and finishes; logprobs equal up to float noise (a step's batch composition,
    which differs between the two ways of running, changes the last bits of its math)."""
    assert [[(tokens, finish, [t for t, _ in lps]) for tokens, finish, lps in samples] for samples in first] == \
        [[(tokens, finish, [t for t, _ in lps]) for tokens, finish, lps in samples] for samples in second]
    for samples_a, samples_b in zip(first, second):
        for (_, _, lps_a), (_, _, lps_b) in zip(samples_a, samples_b):
            assert [lp for _, lp in lps_a] == pytest.approx([lp for _, lp in lps_b], abs=1e-4)


def mixed_requests(first_tokens: list[list[int]] | None) -> list[tuple[list[int], SamplingParams]]:
    batch = prompts(10, seed=21)
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),  # ends while others run on
        SamplingParams(max_tokens=20, temperature=0.9, top_k=40, top_p=0.9, seed=3, logprobs=2),
        SamplingParams(max_tokens=16, temperature=0.7, n=2, seed=8, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, min_p=0.05, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.6, seed=11, ignore_eos=True),
    ]
    if first_tokens is not None:  # stop on a token the sequence produces mid-way: a data-dependent end
        params[7].stop_token_ids = [first_tokens[7][5]]
        params[8].stop_token_ids = [first_tokens[8][2]]
    return list(zip(batch, params))


def test_run_ahead_equals_step_by_step(tiny_model_dir):
    probe, _ = run_async(generate_all(tiny_model_dir, False, mixed_requests(None)))
    requests = mixed_requests([samples[0][0] for samples in probe])
    ahead, ahead_stats = run_async(generate_all(tiny_model_dir, True, requests))
    stepwise, stepwise_stats = run_async(generate_all(tiny_model_dir, False, requests))
    assert_same(ahead, stepwise)
    assert len(ahead[7][0][0]) == 6 and len(ahead[8][0][0]) == 3  # the stop tokens ended them early
    assert ahead_stats["decode_steps_ahead"] > 0
    assert stepwise_stats["decode_steps_ahead"] == 0


def test_run_ahead_under_preemption_equals_step_by_step(tiny_model_dir):
    requests = [(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for p in prompts(8, seed=5)]
    tight = dict(num_kv_blocks=25, max_num_batched_tokens=16)
    ahead, stats = run_async(generate_all(tiny_model_dir, True, requests, **tight))
    stepwise, _ = run_async(generate_all(tiny_model_dir, False, requests))
    assert_same(ahead, stepwise)
    assert stats["preemptions"] > 0 and stats["decode_steps_ahead"] > 0


def test_requests_that_read_their_outputs_wait_for_each_token(tiny_model_dir):
    penalized = [(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3))
                 for p in prompts(3, seed=2)]
    min_tokens = [(p, SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)) for p in prompts(2, seed=4)]
    for requests in (penalized, min_tokens):
        ahead, stats = run_async(generate_all(tiny_model_dir, True, requests))
        stepwise, _ = run_async(generate_all(tiny_model_dir, False, requests))
        assert_same(ahead, stepwise)
        assert stats["decode_steps_ahead"] == 0


@pytest.mark.gpu
def test_run_ahead_equals_step_by_step_on_cuda_with_graphs(tiny_model_dir):
    requests = mixed_requests(None)
    cuda = dict(device="cuda", cuda_graphs=True)
    ahead, stats = run_async(generate_all(tiny_model_dir, True, requests, **cuda))
    stepwise, _ = run_async(generate_all(tiny_model_dir, False, requests, **cuda))
    assert_same(ahead, stepwise)
    assert stats["decode_steps_ahead"] > 0


def test_grammar_rows_run_ahead_and_give_the_same_outputs(tiny_model_dir):
    from pipeline.grammar.spec import GrammarSpec
    from tests.pipeline.grammar.test_structured_output import SCHEMA

    grammars = [GrammarSpec.json_schema(SCHEMA), GrammarSpec("regex", "[a-z]{3,20}"),
                GrammarSpec("regex", "[0-9]{5,30}"), GrammarSpec.choice(["yes", "no", "maybe later"]),
                GrammarSpec("json_object")]
    requests = [(p, SamplingParams(max_tokens=40, temperature=0.9, seed=i, grammar=g, n=2 if i == 0 else 1))
                for i, (p, g) in enumerate(zip(prompts(5, seed=13), grammars))]
    ahead, stats = run_async(generate_all(tiny_model_dir, True, requests))
    stepwise, _ = run_async(generate_all(tiny_model_dir, False, requests))
    assert_same(ahead, stepwise)
    assert stats["decode_steps_ahead"] > 0
