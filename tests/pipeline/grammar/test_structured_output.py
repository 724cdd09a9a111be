"""Structured output through the engine on a tiny random model: whatever the weights want, the
grammar decides what may come out."""
from __future__ import annotations

import asyncio
import json
import re

import pytest

from pipeline.engine import Engine
from pipeline.errors import InvalidRequest
from pipeline.grammar.spec import GrammarSpec
from pipeline.request import FinishReason, SamplingParams
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "size", "color"],
    "additionalProperties": False,
}


def check_schema(value: object) -> None:
    assert isinstance(value, dict) and set(value) == {"ok", "size", "color"}
    assert isinstance(value["ok"], bool)
    assert isinstance(value["size"], int) and 0 <= value["size"] <= 99
    assert value["color"] in ("red", "green", "blue")


async def generate(engine: Engine, spec: GrammarSpec, **params) -> list:
    settings = dict(max_tokens=60, temperature=0.8, seed=3, grammar=spec) | params
    return await collect(engine, prompt_token_ids=[100, 200, 300], params=SamplingParams(**settings))


def test_json_schema_choice_and_regex_outputs_match(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            schema_runs = await asyncio.gather(*[generate(engine, GrammarSpec.json_schema(SCHEMA), seed=s, n=2)
                                                 for s in range(3)])
            choice = await generate(engine, GrammarSpec.choice(["alpha", "beta gamma"]), temperature=1.0)
            regex = await generate(engine, GrammarSpec("regex", r"[a-c]{3}-[0-9]{2}"), temperature=1.0)
            json_object = await generate(engine, GrammarSpec("json_object"), temperature=0.0, max_tokens=40)
            await settle(engine)
            assert_no_leaks(engine)
            return schema_runs, choice, regex, json_object, engine.grammar_compiler().compilations
        finally:
            await engine.shutdown()

    schema_runs, choice, regex, json_object, compilations = run_async(main())
    for samples in schema_runs:
        assert len(samples) == 2
        for sample in samples:
            assert sample.finish_reason is FinishReason.STOP
            check_schema(json.loads(sample.text))
    assert choice[0].text in ("alpha", "beta gamma") and choice[0].finish_reason is FinishReason.STOP
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", regex[0].text)
    if json_object[0].finish_reason is FinishReason.STOP:  # 40 tokens may end inside the object
        assert isinstance(json.loads(json_object[0].text), dict)
    else:
        assert json_object[0].text.lstrip().startswith(("{", "["))
    assert compilations == 4  # the schema compiled once for three requests


def test_a_complete_grammar_ends_the_sample_even_with_ignore_eos(tiny_model_dir):
    """Once the grammar is complete only its stop token is allowed, and recording it ends the sample
    (the matcher is never asked: the device thread owns it)."""
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            runs = await asyncio.gather(*[generate(engine, GrammarSpec.choice(["alpha", "beta gamma"]), seed=s,
                                                   temperature=1.0, ignore_eos=True, max_tokens=50) for s in range(6)])
            await settle(engine)
            assert_no_leaks(engine)
            return runs, engine.loaded.limits.eos_token_ids
        finally:
            await engine.shutdown()

    runs, eos = run_async(main())
    for (sample,) in runs:
        assert sample.text in ("alpha", "beta gamma") and sample.finish_reason is FinishReason.STOP
        assert len(sample.token_ids) < 50 and sample.token_ids[-1] in eos


def test_constrained_and_free_requests_share_a_batch(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            alone = (await collect(engine, prompt_token_ids=[5, 6, 7], params=free))[0].token_ids
            together = await asyncio.gather(collect(engine, prompt_token_ids=[5, 6, 7], params=free),
                                             generate(engine, GrammarSpec.json_schema(SCHEMA)))
            return alone, together
        finally:
            await engine.shutdown()

    alone, (free, constrained) = run_async(main())
    assert free[0].token_ids == alone  # the grammar row's mask touches only its own row
    check_schema(json.loads(constrained[0].text))


@pytest.mark.parametrize("spec, needle", [
    (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "schema"),
    (GrammarSpec("regex", "a(b"), "regex"),
    (GrammarSpec("ebnf", "root ::= undefined_rule"), "ebnf"),
])
def test_a_grammar_that_does_not_compile_is_a_client_error(tiny_model_dir, spec, needle):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            with pytest.raises(InvalidRequest, match=needle):
                await generate(engine, spec)
            assert_no_leaks(engine)
        finally:
            await engine.shutdown()

    run_async(main())


@pytest.mark.gpu
def test_structured_output_on_cuda_with_graphs_and_run_ahead(tiny_model_dir):
    async def main():
        engine = await Engine.create(config_for(tiny_model_dir, device="cuda", cuda_graphs=True))
        try:
            runs = await asyncio.gather(*[generate(engine, GrammarSpec.json_schema(SCHEMA), seed=s) for s in range(6)])
            stats = engine.stats()
            await settle(engine)
            assert_no_leaks(engine)
            return runs, stats
        finally:
            await engine.shutdown()

    runs, stats = run_async(main())
    for samples in runs:
        check_schema(json.loads(samples[0].text))
    assert stats["decode_steps_ahead"] > 0
