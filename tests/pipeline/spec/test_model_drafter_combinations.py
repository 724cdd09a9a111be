"""Every model drafter against the features its verify rows meet, one test per combination: the MTP head and a
DFlash block drafter on a hybrid target, a draft model on a dense target and on a hybrid one, and the target as its own draft model (the
oracle: every draft right, so long accepted runs). Greedy tokens (and finish reasons) equal plain decoding's."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from pipeline.engine import Engine
from pipeline.request import FinishReason, SamplingParams
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle
from tests.model_utils import add_mtp_weights, write_dflash_drafter

pytestmark = pytest.mark.usefixtures("single_torch_thread")

DRAFTERS = ["mtp", "dflash", "draft", "draft-on-hybrid", "oracle"]


@pytest.fixture(scope="module")
def setups(make_model_dir, tiny_model_dir, tmp_path_factory) -> dict[str, tuple[object, dict]]:
    """drafter -> (target directory, engine options)."""
    hybrid = make_model_dir("qwen3_5_moe_text", seed=5)
    add_mtp_weights(hybrid, "qwen3_5_moe_text", seed=5)
    draft = make_model_dir("llama", seed=11)
    dflash = tmp_path_factory.mktemp("dflash")
    write_dflash_drafter(dflash, json.loads((hybrid / "config.json").read_text()), [0, 2], seed=13)
    return {"mtp": (hybrid, dict(speculative_method="mtp", num_speculative_tokens=3)),
            "dflash": (hybrid, dict(speculative_method="dflash", speculative_model=str(dflash),
                                    num_speculative_tokens=4)),
            "draft": (tiny_model_dir, dict(speculative_method="draft", speculative_model=str(draft),
                                           num_speculative_tokens=4)),
            "draft-on-hybrid": (hybrid, dict(speculative_method="draft", speculative_model=str(draft),
                                             num_speculative_tokens=3)),
            "oracle": (tiny_model_dir, dict(speculative_method="draft", speculative_model=str(tiny_model_dir),
                                            num_speculative_tokens=5))}


async def outputs(model_dir, prompts: list[list[int]], params: list[SamplingParams], sequential: bool = False,
                  **overrides) -> tuple[list, dict]:
    """Each request's (tokens, finish reason), and the engine's stats; nothing leaks."""
    engine = await Engine.create(config_for(model_dir, **overrides))
    try:
        if sequential:
            results = [await collect(engine, prompt_token_ids=p, params=q) for p, q in zip(prompts, params)]
        else:
            results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=q)
                                             for p, q in zip(prompts, params)])
        await settle(engine)
        assert_no_leaks(engine)
        return [(r[0].token_ids, r[0].finish_reason) for r in results], engine.stats()
    finally:
        await engine.shutdown()


_PLAIN: dict[str, list] = {}


def plain_outputs(model_dir, prompts, params, sequential: bool = False, **overrides) -> list:
    """Plain decoding's outputs, run once per target and request set: the drafters that share a target compare with
    the same run (an engine without speculation does not depend on which drafter the test is for)."""
    key = repr((str(model_dir), prompts, params, sequential, sorted(overrides.items())))
    if key not in _PLAIN:
        _PLAIN[key], _ = run_async(outputs(model_dir, prompts, params, sequential, **overrides))
    return _PLAIN[key]


def compare(setups, drafter: str, prompts, params, sequential: bool = False, unconstrained: bool = False,
            **overrides) -> tuple[list, dict]:
    """Plain decoding against speculation with ``drafter``. The oracle's drafts are the target's unconstrained
    greedy picks: where nothing else decides the tokens (``unconstrained``) every one is accepted."""
    model_dir, spec = setups[drafter]
    plain = plain_outputs(model_dir, prompts, params, sequential, **overrides)
    got, stats = run_async(outputs(model_dir, prompts, params, sequential, **overrides, **spec))
    assert got == plain
    counted = stats["speculation"]
    assert counted["drafted_tokens"] > 0
    if drafter == "oracle":
        assert counted["accepted_tokens"] == counted["drafted_tokens"] if unconstrained else counted["accepted_tokens"]
    return got, stats


def random_prompts(count: int, seed: int, length: int = 10) -> list[list[int]]:
    rngs = [random.Random(seed + i) for i in range(count)]
    return [[rng.randrange(100, 40000) for _ in range(length + 3 * i)] for i, rng in enumerate(rngs)]


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


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_prefix_cache_hit_and_a_host_tier_restore(setups, drafter):
    """The second round's prompts come from the prefix cache, or from the host tier after the device evicted
    their blocks: the drafter's caches (its K/V, the hidden states) come back with the target's."""
    prompts = random_prompts(3, 4, 20)
    others = random_prompts(3, 40, 50)
    order = prompts + others + prompts
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * len(order)
    _, stats = compare(setups, drafter, order, params, sequential=True, unconstrained=True)
    assert stats["prefix_cache"]["hit_tokens"] > 0
    _, stats = compare(setups, drafter, order, params, sequential=True, unconstrained=True, num_kv_blocks=40,
                    kv_offload_host_gib=16 / 1024)
    assert stats["kv_offload"]["restored_blocks"] > 0


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_preemption_in_the_middle_of_verifying(setups, drafter):
    """A pool too small for every sequence: sequences that draft and verify are preempted (recomputed, or swapped
    to host and back) and resume, their drafter's record of them started over."""
    prompts = random_prompts(8, 5, 5)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * len(prompts)
    for extra in ({}, {"kv_offload_host_gib": 16 / 1024}):
        _, stats = compare(setups, drafter, prompts, params, unconstrained=True, num_kv_blocks=25,
                        max_num_batched_tokens=16, **extra)
        assert stats["preemptions"] > 0


@pytest.mark.parametrize("drafter", ["mtp", "dflash"])
def test_a_drafter_failing_on_promised_drafts_fails_the_requests(setups, drafter):
    """Promised drafts (the verify step planned while the drafter runs): a drafter error reaches the requests as an
    engine failure, at the step that feeds its drafts; nothing hangs and nothing runs on unwritten drafts."""
    model_dir, spec = setups[drafter]

    async def main() -> None:
        engine = await Engine.create(config_for(model_dir, **spec))
        served = engine.decode.drafter
        calls = []

        def draft(plan, into=None):
            calls.append(into)
            if len(calls) == 3:
                raise ValueError("drafter broke")
            return type(served).draft(served, plan, into)

        served.draft = draft
        try:
            with pytest.raises(Exception) as failure:
                await asyncio.wait_for(collect(engine, prompt_token_ids=random_prompts(1, 3)[0],
                                               params=SamplingParams(max_tokens=40, temperature=0.0,
                                                                     ignore_eos=True)), 60)
            assert not isinstance(failure.value, asyncio.TimeoutError)
            assert "drafter broke" in repr(failure.value) or "drafter failed" in repr(failure.value)
            assert len(calls) == 3 and all(into is not None for into in calls)  # promised every time
        finally:
            await engine.shutdown()

    run_async(main())
