"""Every model drafter against the features its verify rows meet, one test per combination: the MTP head and a
DFlash block drafter on a hybrid target, a draft model on a dense target and on a hybrid one, and the target as its
own draft model (the oracle: every draft right, so long accepted runs); tests/pipeline/spec/drafter_combinations.py
holds them. Here grammars, penalties, stops and the loop guard; caches and preemption in
test_model_drafter_cache_and_preemption.py. Greedy tokens (and finish reasons) equal plain decoding's."""
from __future__ import annotations

import pytest

from pipeline.request import FinishReason, SamplingParams
from tests.pipeline.spec.drafter_combinations import DRAFTERS, build_setups, compare, plain_outputs, random_prompts

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def setups(make_model_dir, tiny_model_dir, tmp_path_factory) -> dict[str, tuple[object, dict]]:
    return build_setups(make_model_dir, tiny_model_dir, tmp_path_factory)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_json_schema_and_tool_grammars(setups, drafter):
    from pipeline.grammar.spec import GrammarSpec
    from tests.pipeline.grammar.test_structured_output import SCHEMA
    from web.tool_grammar import tool_call_grammar

    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
    grammars = [GrammarSpec.json_schema(SCHEMA), tool_call_grammar("hermes", tools, "required"),
                tool_call_grammar("qwen3_coder", tools, "required")]
    params = [SamplingParams(max_tokens=60, temperature=0.0, grammar=g) for g in grammars]
    _, stats = compare(setups, drafter, random_prompts(3, 1), params)
    assert stats["speculation"]["device_drafts"] == 0  # a grammar's masks follow the drafts: read before the step


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_repetition_and_presence_penalties(setups, drafter):
    params = [SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, repetition_penalty=1.3 if i else 0.7,
                             presence_penalty=-2.0 if i else 1.0, frequency_penalty=-1.0) for i in range(3)]
    _, stats = compare(setups, drafter, random_prompts(3, 2), params)
    assert stats["speculation"]["device_drafts"] == 0  # the penalties count the drafts: read before the step


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_stop_strings_stop_ids_min_tokens_and_logit_bias(setups, drafter):
    model_dir, _ = setups[drafter]
    prompts = random_prompts(4, 3)
    plain = plain_outputs(model_dir, prompts, [SamplingParams(max_tokens=60, temperature=0.0)] * 4)
    from pipeline.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(str(model_dir))
    stop = tokenizer.decode(plain[0][0][25:27])
    params = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop=[stop]),
              SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop_token_ids=[plain[1][0][30]]),
              SamplingParams(max_tokens=60, temperature=0.0, min_tokens=40),
              SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logit_bias={prompts[3][0]: 4.0})]
    compare(setups, drafter, prompts, params)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_the_loop_guard_ends_a_loop_at_the_same_token(setups, drafter):
    """A logit bias makes one request repeat a token; the loop guard truncates it at the same token as without
    drafts."""
    params = [SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, logit_bias={4321: 30.0}),
              SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)]
    got, _ = compare(setups, drafter, random_prompts(2, 6), params)
    assert got[0][1] == FinishReason.LENGTH and len(got[0][0]) < 300  # truncated by the guard
