"""Speculation with the row state a draft advances: penalty counts, grammar masks and thinking budgets at each
verified position as if the drafts before it were accepted; the tokens equal plain decoding's."""
from __future__ import annotations

import asyncio

import pytest

from pipeline.engine import Engine
from pipeline.request import SamplingParams
from pipeline.spec.replay import ReplayDrafter
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle
from tests.pipeline.spec.test_engine_speculation import SPEC, prompts, run

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_penalties_count_the_drafts_before_each_position(tiny_model_dir):
    """Repetition, presence and frequency penalties: each verified position counts the drafts before it as if
    accepted, so the tokens equal plain decoding's, greedy and seeded, with drafts right and wrong."""
    batch = prompts(4)
    # negative presence/frequency penalties pull the output towards its own tokens: a row that missed the drafts
    # before it would pick differently
    params = [SamplingParams(max_tokens=150, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True,
                             repetition_penalty=1.3 if i < 2 else 0.7, presence_penalty=-2.0, frequency_penalty=-1.0)
              for i in range(len(batch))]
    plain, _ = run_async(run(tiny_model_dir, batch, params))
    expected = {tuple(p): out[0] for p, out in zip(batch, plain)}

    spec, stats = run_async(run(tiny_model_dir, batch, params, ReplayDrafter(expected, 0.2), **SPEC))
    counted = stats["speculation"]
    assert spec == plain and counted["accepted_tokens"] > counted["verify_rows"]


def test_grammars_mask_each_position_after_the_drafts_before_it(tiny_model_dir):
    """json_schema, regex and choice requests, greedy and seeded: each verified position's mask is the grammar's
    after the drafts before it (the matcher takes them and is rolled back); wrong drafts, some of which the grammar
    refuses, are rejected. The same tokens as plain decoding, and the outputs still match their grammars."""
    from pipeline.grammar.spec import GrammarSpec
    from tests.pipeline.grammar.test_structured_output import SCHEMA

    specs = [GrammarSpec.json_schema(SCHEMA), GrammarSpec("regex", r"[a-c]{3}-[0-9]{2}( [a-z]{2,6}){1,5}"),
             GrammarSpec.choice(["alpha beta gamma delta", "epsilon zeta"]), GrammarSpec.json_schema(SCHEMA)]
    batch = [[100, 200, 300 + i] for i in range(len(specs))]
    params = [SamplingParams(max_tokens=80, temperature=0.0 if i % 2 else 0.9, seed=i, grammar=spec)
              for i, spec in enumerate(specs)]

    async def main(drafter_of=None, **overrides) -> tuple[list, dict]:
        engine = await Engine.create(config_for(tiny_model_dir, **overrides))
        if drafter_of is not None:
            engine.decode.drafter = drafter_of
        try:
            results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=q)
                                             for p, q in zip(batch, params)])
            await settle(engine)
            assert_no_leaks(engine)
            return [[(s.token_ids, s.finish_reason) for s in r] for r in results], engine.stats()["speculation"]
        finally:
            await engine.shutdown()

    plain, _ = run_async(main())
    expected = {tuple(p): out[0][0] for p, out in zip(batch, plain)}
    for error in (0.0, 0.3):
        spec, counted = run_async(main(ReplayDrafter(expected, error), **SPEC))
        assert spec == plain and counted["accepted_tokens"] > 0


def test_a_thinking_budget_forces_its_closing_tag_at_the_same_position(tiny_model_dir):
    """A budget spent inside a verify row: the row after the drafts that spend it forces the closing tag there, as
    plain decoding does; drafts that skip the tag are rejected."""
    async def main(drafter=None, **overrides) -> tuple[list[list[int]], list]:
        engine = await Engine.create(config_for(tiny_model_dir, **overrides))
        if drafter is not None:
            engine.decode.drafter = drafter
        try:
            start = list(engine.loaded.limits.thinking_tags.start_ids)
            prompts_ = [[100, 200, *start, i] for i in range(3)]  # the prompts open the thinking block
            params = [SamplingParams(max_tokens=40, temperature=t, seed=1, ignore_eos=True, thinking_token_budget=b)
                      for t, b in ((0.0, 5), (0.8, 9), (0.0, 0))]
            results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=q)
                                             for p, q in zip(prompts_, params)])
            await settle(engine)
            assert_no_leaks(engine)
            return prompts_, [r[0].token_ids for r in results]
        finally:
            await engine.shutdown()

    prompts_, plain = run_async(main())
    expected = {tuple(p): out for p, out in zip(prompts_, plain)}
    for error in (0.0, 0.3):
        assert run_async(main(ReplayDrafter(expected, error), **SPEC))[1] == plain
