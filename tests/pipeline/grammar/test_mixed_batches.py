"""Constrained and unconstrained sequences in one batch, on a tiny random model: each sequence gets the tokens it gets
alone (the step's mask touches only the rows a grammar constrains), greedy and seeded alike; and a grammar that does
not compile, or a matcher that refuses a token, ends only its own request."""
from __future__ import annotations

import asyncio

import pytest

from pipeline.engine import Engine
from pipeline.errors import InvalidRequest
from pipeline.grammar.spec import GrammarSpec
from pipeline.request import FinishReason, SamplingParams
from pipeline.runner import logits_pipeline
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
          "required": ["name", "tags"], "additionalProperties": False}
# (prompt, sampling params): constrained and free, greedy and seeded, rows that end early and rows that run on
REQUESTS = [
    ([5, 6, 7], dict(temperature=0.0, ignore_eos=True)),
    ([8, 9], dict(temperature=0.9, seed=11, ignore_eos=True)),
    ([10, 11, 12, 13], dict(temperature=0.8, seed=3, grammar=GrammarSpec.json_schema(SCHEMA))),
    ([14, 15], dict(temperature=0.0, grammar=GrammarSpec("regex", r"[a-c]{2,12}-[0-9]{1,6}"))),
    ([16], dict(temperature=1.0, seed=5, grammar=GrammarSpec.choice(["alpha", "beta gamma", "delta"]))),
    ([17, 18, 19], dict(temperature=1.1, seed=8, ignore_eos=True, grammar=GrammarSpec("json_object"))),
    ([20, 21], dict(temperature=0.0, grammar=GrammarSpec("ebnf", 'root ::= ("x" | "yz")+ "."'))),
]


def params(settings: dict) -> SamplingParams:
    return SamplingParams(**dict(max_tokens=24, repetition_detection=False) | settings)


async def run(engine: Engine, prompt: list[int], settings: dict):
    (sample,) = await collect(engine, prompt_token_ids=prompt, params=params(settings))
    return sample


def test_each_sequence_of_a_mixed_batch_gets_the_tokens_it_gets_alone(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            alone = [await run(engine, prompt, settings) for prompt, settings in REQUESTS]
            together = await asyncio.gather(*[run(engine, prompt, settings) for prompt, settings in REQUESTS])
            again = await asyncio.gather(*[run(engine, prompt, settings) for prompt, settings in REQUESTS[::-1]])
            stats = engine.stats()
            await settle(engine)
            assert_no_leaks(engine)
            return alone, together, again[::-1], stats
        finally:
            await engine.shutdown()

    alone, together, reversed_order, stats = run_async(main())
    for i, (one, mixed, other) in enumerate(zip(alone, together, reversed_order)):
        assert mixed.token_ids == one.token_ids, f"request {i}"
        assert other.token_ids == one.token_ids, f"request {i} (other rows)"
        assert mixed.finish_reason == one.finish_reason
    assert alone[4].text in ("alpha", "beta gamma", "delta") and alone[4].finish_reason is FinishReason.STOP
    assert alone[0].finish_reason is FinishReason.LENGTH and len(alone[0].token_ids) == 24
    assert stats["decode_steps_ahead"] > 0  # the constrained rows ran one step ahead with the others


def alone_and_beside(model_dir, free: list, odd: tuple, patch=lambda: None):
    """Each of the ``free`` (prompt, settings) requests alone; then, after ``patch()``, all of them at once beside the
    ``odd`` one: (the alone results, the free results beside it, the odd one's result or exception), checked to leak
    nothing."""
    async def main():
        engine = await Engine.create(config_for(model_dir))
        try:
            alone = [await run(engine, prompt, settings) for prompt, settings in free]
            patch()
            *beside, odd_result = await asyncio.gather(*[run(engine, prompt, settings) for prompt, settings in free],
                                                       run(engine, *odd), return_exceptions=True)
            await settle(engine)
            assert_no_leaks(engine)
            return alone, beside, odd_result
        finally:
            await engine.shutdown()

    return run_async(main())


def test_a_grammar_that_does_not_compile_ends_only_its_request(tiny_model_dir):
    bad_regex = GrammarSpec("regex", "a(b")
    alone, beside, bad = alone_and_beside(tiny_model_dir, REQUESTS[:4], ([30, 31], dict(grammar=bad_regex)))
    assert isinstance(bad, InvalidRequest) and "regex" in str(bad)
    assert [r.token_ids for r in beside] == [a.token_ids for a in alone]


def test_a_matcher_that_refuses_a_token_ends_only_its_request(tiny_model_dir, monkeypatch):
    """Masks off (only a bug lets a sampled token past its grammar): each constrained request ends at the first
    token its matcher refuses; the free requests beside them decode as they do alone, and nothing leaks."""
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            alone = [await run(engine, prompt, settings) for prompt, settings in REQUESTS[:2]]
            steps = [(name, (lambda logits, batch: logits) if name == "grammar_bitmask" else step)
                     for name, step in logits_pipeline.LOGITS_STEPS]
            monkeypatch.setattr(logits_pipeline, "LOGITS_STEPS", steps)
            results = await asyncio.gather(*[run(engine, prompt, settings) for prompt, settings in REQUESTS])
            await settle(engine)
            assert_no_leaks(engine)
            return alone, results
        finally:
            await engine.shutdown()

    alone, results = run_async(main())
    assert [r.token_ids for r in results[:2]] == [a.token_ids for a in alone]
    refused = [r for r in results[2:] if r.finish_reason is FinishReason.STOP and len(r.token_ids) < 24]
    assert len(refused) >= 3, [(r.text, r.finish_reason) for r in results[2:]]  # the refusals end their requests
    assert all(r.finish_reason is not None for r in results)


@pytest.mark.parametrize("run_ahead", [True, False])
def test_a_constrained_row_alone_and_beside_many_free_rows(tiny_model_dir, run_ahead):
    """One grammar row among fifteen free ones: its mask is one bitmask row and it changes no other row."""
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir, run_ahead=run_ahead))
        try:
            constrained = ([40, 41], dict(temperature=0.7, seed=9, grammar=GrammarSpec.json_schema(SCHEMA)))
            free = [([50 + i, 60 + i], dict(temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=True))
                    for i in range(15)]
            alone = [await run(engine, *constrained)] + [await run(engine, *r) for r in free[:3]]
            together = await asyncio.gather(run(engine, *constrained), *[run(engine, *r) for r in free])
            await settle(engine)
            assert_no_leaks(engine)
            return alone, together
        finally:
            await engine.shutdown()

    alone, together = run_async(main())
    assert [s.token_ids for s in together[:4]] == [s.token_ids for s in alone]


def test_a_compiler_that_breaks_ends_only_its_request(tiny_model_dir, monkeypatch):
    """An unexpected error inside the grammar compiler (not a bad grammar: a bug or a broken install) fails that
    request with a server error naming it; the requests beside it decode as they do alone, and nothing leaks."""
    from pipeline.errors import RequestFailed
    from pipeline.grammar.compiler import GrammarCompiler

    real_compile = GrammarCompiler.compile

    async def compile_or_break(self, spec):
        if spec.kind == "regex" and spec.source == "broken":
            raise RuntimeError("the compiler broke")
        return await real_compile(self, spec)

    alone, beside, broken = alone_and_beside(
        tiny_model_dir, REQUESTS[:3], ([30, 31], dict(grammar=GrammarSpec("regex", "broken"))),
        lambda: monkeypatch.setattr(GrammarCompiler, "compile", compile_or_break))
    assert isinstance(broken, RequestFailed) and "RuntimeError" in str(broken)
    assert [r.token_ids for r in beside] == [a.token_ids for a in alone]
