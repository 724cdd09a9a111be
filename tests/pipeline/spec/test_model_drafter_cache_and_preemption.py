"""Every model drafter (tests/pipeline/spec/drafter_combinations.py) where its caches and records must follow the
target's: a prefix-cache hit and a host-tier restore, preemption in the middle of verifying, and a drafter that fails
on promised drafts. Greedy tokens (and finish reasons) equal plain decoding's."""
from __future__ import annotations

import asyncio

import pytest

from pipeline.engine import Engine
from pipeline.request import SamplingParams
from tests.conftest import run_async
from tests.engine_utils import collect, config_for
from tests.pipeline.spec.drafter_combinations import DRAFTERS, build_setups, compare, random_prompts

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def setups(make_model_dir, tiny_model_dir, tmp_path_factory) -> dict[str, tuple[object, dict]]:
    return build_setups(make_model_dir, tiny_model_dir, tmp_path_factory)


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
