"""Speculation through the whole stage graph (n-gram drafts verified in the decode step's forward): the output
equals decoding without it, token for token, greedy and seeded, alone and in batches, with the features its rows
meet; drafts are offered and accepted; nothing leaks."""
from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest

from pipeline.engine import Engine
from pipeline.request import FinishReason, SamplingParams
from pipeline.spec.drafter import HostDrafter
from pipeline.spec.replay import ReplayDrafter
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def prompts(count: int) -> list[list[int]]:
    """Prompts that repeat themselves (as code and quoted tool output do): the n-gram drafter has matches."""
    out = []
    for i in range(count):
        rng = random.Random(100 + i)
        motif = [rng.randrange(100, 40000) for _ in range(6 + i)]
        out.append(motif * 3 + [rng.randrange(100, 40000) for _ in range(3)] + motif[:4])
    return out


async def run(model_dir, batch: list[list[int]], params: list[SamplingParams], drafter=None,
              budget_rows: int | None = None, **overrides) -> tuple[list, dict]:
    """Each sample's tokens and the engine's stats; ``drafter`` replaces the configured one (``**SPEC`` sets K)."""
    engine = await Engine.create(config_for(model_dir, **overrides))
    if drafter is not None:
        engine.decode.drafter = drafter
    if budget_rows is not None:
        engine.decode.draft_budget.max_rows = budget_rows
    try:
        results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=q) for p, q in zip(batch, params)])
        await settle(engine)
        assert_no_leaks(engine)
        return [[s.token_ids for s in r] for r in results], engine.stats()
    finally:
        await engine.shutdown()


def greedy(max_tokens: int = 220, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_equals_plain_decoding(tiny_model_dir, batch_size):
    batch = prompts(batch_size)
    params = [greedy() for _ in batch]
    plain, _ = run_async(run(tiny_model_dir, batch, params))
    spec, stats = run_async(run(tiny_model_dir, batch, params, **SPEC))
    assert spec == plain
    assert all(len(r[0]) == 220 for r in spec)
    counted = stats["speculation"]
    assert counted["method"] == "ngram" and counted["drafted_tokens"] > 0 and counted["accepted_tokens"] > 0
    assert sum(counted["accepted_per_row"]) == counted["verify_rows"]


def test_seeded_sampling_equals_plain_decoding(tiny_model_dir):
    """Each verified position draws with the random key plain decoding uses there, so a seeded request gives the
    same tokens with drafts or without; n > 1 too."""
    batch = prompts(4)
    params = [SamplingParams(max_tokens=120, temperature=0.8, top_p=0.9, top_k=50, seed=7 + i, ignore_eos=True,
                             n=2 if i == 0 else 1) for i in range(len(batch))]
    plain, _ = run_async(run(tiny_model_dir, batch, params))
    # sampled output seldom repeats itself: the drafts replay the plain output (the second sample's are its sibling's)
    expected = {tuple(p): out[0] for p, out in zip(batch, plain)}
    spec, stats = run_async(run(tiny_model_dir, batch, params, ReplayDrafter(expected, 0.3), **SPEC))
    assert spec == plain and stats["speculation"]["accepted_tokens"] > 0


def test_stops_limits_bias_and_the_loop_guard_act_on_accepted_tokens(tiny_model_dir):
    """max_tokens that ends inside a verified run, stop ids, min_tokens holding eos back, logit_bias, logprobs, and
    the loop guard (which greedy random weights trip): the same tokens and finish reasons as without drafts."""
    batch = prompts(5)
    params = [greedy(37), greedy(150, stop_token_ids=[batch[1][2], batch[1][5]]),
              SamplingParams(max_tokens=60, temperature=0.0, min_tokens=40),
              greedy(80, logit_bias={batch[3][0]: 5.0}, logprobs=2),
              SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)]

    async def main(**overrides) -> list:
        engine = await Engine.create(config_for(tiny_model_dir, **overrides))
        try:
            results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=q)
                                             for p, q in zip(batch, params)])
            await settle(engine)
            assert_no_leaks(engine)
            return [[(s.token_ids, s.finish_reason, [round(lp.logprob, 4) for lp in s.logprobs]) for s in r]
                    for r in results]
        finally:
            await engine.shutdown()

    assert run_async(main(**SPEC)) == run_async(main())


def test_speculation_options_are_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="both"):
        config_for(tiny_model_dir, speculative_method="ngram").validate()
    with pytest.raises(ValueError, match="drafters"):
        config_for(tiny_model_dir, speculative_method="eagle", num_speculative_tokens=2).validate()
    with pytest.raises(ValueError, match="between"):
        config_for(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=99).validate()


@pytest.mark.parametrize("error", [0.0, 0.3])
def test_long_accepted_runs_and_rejections_anywhere_equal_plain_decoding(tiny_model_dir, error):
    """Eight requests, 220 tokens each, greedy and seeded: drafts mostly right (or all right) give the same tokens
    as plain decoding, and are accepted as often as they are right."""
    batch = prompts(8)
    params = [greedy() if i % 2 else SamplingParams(max_tokens=220, temperature=0.7, seed=i, ignore_eos=True)
              for i in range(len(batch))]
    plain, _ = run_async(run(tiny_model_dir, batch, params))
    expected = {tuple(p): out[0] for p, out in zip(batch, plain)}

    spec, stats = run_async(run(tiny_model_dir, batch, params, ReplayDrafter(expected, error),
                                **{**SPEC, "num_speculative_tokens": 6}))
    assert spec == plain
    counted = stats["speculation"]
    # a row of 6 drafts each wrong with probability e accepts sum(0.7 ** i for i in 1..6) ~ 1.9 of them at e = 0.3
    assert counted["accepted_tokens"] > (0.9 if not error else 0.25) * counted["drafted_tokens"]
    if error:
        assert sum(counted["accepted_per_row"][:-1]) > 0  # rejections happened at some position of a row
    assert stats["device_steps"] < 8 * 220 / 2  # fewer steps than one token a step


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama", "qwen3_5_moe_text"])
def test_gpu_verify_rows_through_cuda_graphs(tiny_model_dir, make_model_dir, model):
    """On CUDA (fp32), the verify rows of K + 1 tokens replay the graphs captured for them (and, hybrid, keep and
    rewind their states): drafts replaying plain decoding's tokens give those tokens on the same device."""
    if model != "llama":
        tiny_model_dir = make_model_dir(model, seed=5)
    batch = prompts(4)
    params = [greedy(120) for _ in batch]
    plain, _ = run_async(run(tiny_model_dir, batch, params, device="cuda"))
    expected = {tuple(p): out[0] for p, out in zip(batch, plain)}

    spec, stats = run_async(run(tiny_model_dir, batch, params, ReplayDrafter(expected, 0.2), device="cuda", **SPEC))
    assert spec == plain and stats["speculation"]["accepted_tokens"] > 0


def test_drafts_shrink_where_they_fail_and_stop_in_large_batches(tiny_model_dir):
    """Drafts that are always wrong: each sequence's chances to draft come 1, 2, 4, 8, 16, 16 .. steps apart, the
    later ones with one draft (the output still equal). A batch above the budget's row limit drafts nothing until it
    shrinks to the limit."""
    batch = prompts(4)
    params = [greedy(100) for _ in batch]
    plain, _ = run_async(run(tiny_model_dir, batch, params))
    expected = {tuple(p): out[0] for p, out in zip(batch, plain)}

    def main(error: float, max_rows: int) -> tuple[list, dict]:
        out, stats = run_async(run(tiny_model_dir, batch, params, ReplayDrafter(expected, error), max_rows,
                                   **{**SPEC, "num_speculative_tokens": 6}))
        return out, stats["speculation"]

    wrong, counted = main(1.0, 32)
    assert wrong == plain and counted["accepted_tokens"] == 0
    assert counted["verify_rows"] <= 4 * 10  # 9 chances in 100 tokens (one more where a step is still in flight)
    assert counted["drafted_tokens"] < 6 * counted["verify_rows"]  # under 0.3 acceptance: one draft a row
    limited, counted = main(0.0, 3)
    # four sequences, 100 tokens each: rows draft only once fewer than four run (their ends, if staggered)
    assert limited == plain and counted["verify_rows"] < 100


@pytest.fixture(scope="module")
def hybrid_dir(make_model_dir):
    return make_model_dir("qwen3_5_moe_text", seed=5)


@pytest.mark.parametrize("error", [0.0, 0.3])
def test_hybrid_model_takes_back_a_kept_state_after_a_rejection(hybrid_dir, error):
    """Gated DeltaNet layers: a verify row keeps its state after each token but the last in spare slots; after a
    rejection the one after the last accepted token goes into the sequence's slot, so the tokens equal plain
    decoding's (greedy, seeded, n > 1, a prefix cache hit on the repeated prompt), and every slot, spare ones
    included, is given back."""
    batch = prompts(5) + [prompts(1)[0]]  # the last repeats the first: its prompt comes from the cache
    params = [greedy(90) if i % 2 else SamplingParams(max_tokens=90, temperature=0.8, seed=i, ignore_eos=True,
                                                       n=2 if i == 2 else 1) for i in range(len(batch))]

    async def main(drafter=None, **overrides) -> tuple[list, dict]:
        engine = await Engine.create(config_for(hybrid_dir, **overrides))
        if drafter is not None:
            engine.decode.drafter = drafter
        try:
            results = []
            for group in (batch[:5], batch[5:]):
                results += await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=q)
                                                  for p, q in zip(group, params[len(results):])])
            await settle(engine)
            assert_no_leaks(engine)
            return [[s.token_ids for s in r] for r in results], engine.stats()
        finally:
            await engine.shutdown()

    plain, _ = run_async(main())
    expected = {tuple(p): out[0] for p, out in zip(batch, plain)}
    spec, stats = run_async(main(ReplayDrafter(expected, error), **SPEC))
    assert spec == plain
    counted = stats["speculation"]
    assert counted["accepted_tokens"] > 0 and stats["state_slots_used"] == 0
    if error:
        assert sum(counted["accepted_per_row"][:-1]) > 0  # rejections: kept states taken back


class FixedDrafter(HostDrafter):
    """Drafts ``guess`` for every sequence's second output token."""

    name = "fixed"

    def __init__(self, guess: int) -> None:
        self.guess = guess

    def propose(self, seq, k: int) -> list[int]:
        return [self.guess] if seq.num_output_tokens == 1 else []


def test_sampled_token_at_a_verified_position_follows_the_target_distribution(tiny_model_dir):
    """A small vocabulary (top_k 5, temperature 1), 500 seeds, a fixed draft for the second token. Among the
    requests whose first token is the commonest one, the second token (picked by the verify row) follows the target
    distribution there (softmax of the raw top-5 logprobs) within a total variation of 0.08, and the draft is
    accepted as often as the target picks it (within 0.08); every request's tokens equal plain decoding's."""
    prompt = prompts(1)[0]
    seeded = [SamplingParams(max_tokens=3, temperature=1.0, top_k=5, ignore_eos=True, seed=seed)
              for seed in range(500)]
    plain, _ = run_async(run(tiny_model_dir, [prompt] * len(seeded), seeded, prefix_caching=False))
    plain = [r[0] for r in plain]
    firsts = [t[0] for t in plain]
    first = max(set(firsts), key=firsts.count)

    async def target() -> list[tuple[int, float]]:
        engine = await Engine.create(config_for(tiny_model_dir))
        try:
            out = await collect(engine, prompt_token_ids=prompt + [first],
                                params=SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
            return out[0].logprobs[0].top
        finally:
            await engine.shutdown()

    weights = {token: math.exp(logprob) for token, logprob in run_async(target())}
    total = sum(weights.values())
    guess = max(weights, key=weights.get)
    spec, stats = run_async(run(tiny_model_dir, [prompt] * len(seeded), seeded, FixedDrafter(guess),
                                prefix_caching=False, **SPEC))
    assert [r[0] for r in spec] == plain
    counted = stats["speculation"]
    assert counted["verify_rows"] == len(seeded)
    second = [r[0][1] for r in spec if r[0][0] == first]
    assert len(second) >= 100
    variation = 0.5 * sum(abs(second.count(token) / len(second) - w / total) for token, w in weights.items())
    variation += 0.5 * sum(t not in weights for t in second) / len(second)
    assert variation < 0.08, (variation, len(second))
    assert abs(second.count(guess) / len(second) - weights[guess] / total) < 0.08  # the draft accepted that often


def test_stop_strings_end_inside_a_verified_run(tiny_model_dir):
    """A stop string that completes in the middle of a row's accepted tokens: the text ends before it and the
    tokens after it are dropped, as without drafts."""
    batch = prompts(3)
    plain, _ = run_async(run(tiny_model_dir, batch, [greedy(60) for _ in batch]))

    async def texts(drafter=None, **overrides) -> list[tuple[str, object]]:
        engine = await Engine.create(config_for(tiny_model_dir, **overrides))
        if drafter is not None:
            engine.decode.drafter = drafter
        try:
            stops = [engine.tokenizer.decode(out[0][20 + 7 * i:22 + 7 * i]) for i, out in enumerate(plain)]
            results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=greedy(60, stop=[stop]))
                                             for p, stop in zip(batch, stops)])
            await settle(engine)
            assert_no_leaks(engine)
            return [(r[0].text, r[0].finish_reason) for r in results]
        finally:
            await engine.shutdown()

    expected = {tuple(p): out[0] for p, out in zip(batch, plain)}
    without = run_async(texts())
    assert all(reason == FinishReason.STOP for _, reason in without)
    assert run_async(texts(ReplayDrafter(expected), **SPEC)) == without


def test_prefix_cache_hits_and_host_restores_then_verify(tiny_model_dir):
    """Drafts verified over a prompt taken from the prefix cache, and over one whose blocks came back from the host
    tier after the device evicted them: every attention path reads the same blocks, the tokens equal plain
    decoding's."""
    batch = prompts(4)
    others = [[random.Random(200 + i).randrange(100, 40000) for _ in range(60)] for i in range(3)]
    order = batch + others + batch  # the second round hits the cache or the host tier
    params = [greedy(40) for _ in order]

    async def sequential(drafter=None, **overrides) -> tuple[list, dict]:
        engine = await Engine.create(config_for(tiny_model_dir, **overrides))
        if drafter is not None:
            engine.decode.drafter = drafter
        try:
            results = [(await collect(engine, prompt_token_ids=p, params=q))[0].token_ids for p, q in
                       zip(order, params)]
            await settle(engine)
            assert_no_leaks(engine)
            return results, engine.stats()
        finally:
            await engine.shutdown()

    plain, _ = run_async(sequential(prefix_caching=False))
    expected = {tuple(p): out for p, out in zip(order, plain)}
    cached, stats = run_async(sequential(ReplayDrafter(expected, 0.3), **SPEC))
    assert cached == plain and stats["prefix_cache"]["hit_tokens"] > 0 and stats["speculation"]["verify_rows"] > 0
    tiers = dict(num_kv_blocks=60, kv_offload_host_gib=16 / 1024)
    restored, stats = run_async(sequential(ReplayDrafter(expected, 0.3), **SPEC, **tiers))
    assert restored == plain and stats["kv_offload"]["restored_blocks"] > 0


def test_preemption_between_verify_steps(tiny_model_dir, make_model_dir):
    """A pool too small for every sequence: sequences that verify drafts are preempted (recomputed, or swapped to
    host and back) and resume; the tokens equal those with room, for a dense and a hybrid model."""
    for model_dir in (tiny_model_dir, make_model_dir("qwen3_5_moe_text", seed=6)):
        batch = [[random.Random(300 + i).randrange(100, 40000) for _ in range(5 + 3 * i)] for i in range(8)]
        params = [greedy(30) for _ in batch]
        plain, _ = run_async(run(model_dir, batch, params))
        expected = {tuple(p): out[0] for p, out in zip(batch, plain)}
        tight = dict(num_kv_blocks=25, max_num_batched_tokens=16, **SPEC)
        for extra in ({}, {"kv_offload_host_gib": 16 / 1024}):
            got, stats = run_async(run(model_dir, batch, params, ReplayDrafter(expected, 0.3), **tight, **extra))
            assert got == plain and stats["preemptions"] > 0 and stats["speculation"]["verify_rows"] > 0


@pytest.mark.parametrize("model", ["llama", "qwen3_5_moe_text"])
def test_steps_with_drafts_give_every_row_one_length(tiny_model_dir, make_model_dir, model):
    """A step with drafts pads its other rows with filler drafts, its rows all K + 1 tokens (the shape a CUDA graph
    serves), save rows at their length limit; the fillers are counted apart from the drafter's drafts. A hybrid
    model's rows keep their states after each token (no row feeds a token twice). The tokens equal plain
    decoding's."""
    model_dir = tiny_model_dir if model == "llama" else make_model_dir(model, seed=5)
    batch = prompts(3)
    params = [greedy(60 + 30 * i) for i in range(len(batch))]
    plain, _ = run_async(run(model_dir, batch, params))
    expected = {tuple(p): out[0] for p, out in zip(batch, plain)}

    kept: list[bool] = []  # per step of several-token rows: whether it keeps recurrent states

    async def main() -> tuple[list, dict, list[bool]]:
        engine = await Engine.create(config_for(model_dir, **SPEC))
        engine.decode.drafter = ReplayDrafter(expected, 0.3)
        shapes: list[bool] = []
        launch = engine.executor._launch

        def recording(plan, *args):
            forward = plan.forward
            lengths = set(np.diff(forward.query_start_loc).tolist())
            if 1 < max(lengths) <= SPEC["num_speculative_tokens"] + 1:  # rows of several tokens, no prompt
                shapes.append(forward.is_uniform_decode)
                kept.append(forward.keeps_states)
            return launch(plan, *args)

        engine.executor._launch = recording
        try:
            results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=q)
                                             for p, q in zip(batch, params)])
            await settle(engine)
            assert_no_leaks(engine)
            return [[s.token_ids for s in r] for r in results], engine.stats()["speculation"], shapes
        finally:
            await engine.shutdown()

    spec, counted, shapes = run_async(main())
    assert spec == plain and counted["accepted_tokens"] > 0
    assert counted["filler_tokens"] > 0
    assert not any(kept) if model == "llama" else sum(kept) >= len(kept) - 6  # (a resumed prompt's chunk keeps none)
    assert len(shapes) > 20 and sum(shapes) >= len(shapes) - 6  # (the rows near their ends cannot be padded)


def test_the_verify_stage_drafts_and_reports_like_every_stage(tiny_model_dir):
    """Decode asks the verify stage for each drafting step's drafts: its requests in and out, waits, service times
    and batch sizes show in the stats (/debug/stages) beside the other stages'; without speculation it sees none."""
    batch = prompts(3)
    params = [greedy(60) for _ in batch]
    _, plain = run_async(run(tiny_model_dir, batch, params))
    _, spec = run_async(run(tiny_model_dir, batch, params, **SPEC))
    assert plain["stages"]["verify"]["items_in"] == 0
    verify = spec["stages"]["verify"]
    assert verify["items_in"] == verify["items_out"] > 0 and verify["inbox_depth"] == 0
    assert verify["batch_size"]["count"] == verify["items_in"] and verify["service_time_s"]["count"] > 0
