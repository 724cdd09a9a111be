"""What the model-drafter combination tests share: each drafter's target and engine options, plain decoding against
speculation on the same requests, and the requests. The tests are split over two modules
(test_model_drafter_combinations.py, test_model_drafter_cache_and_preemption.py) so a pytest worker can take each."""
from __future__ import annotations

import asyncio
import json
import random

from pipeline.engine import Engine
from pipeline.request import SamplingParams
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle
from tests.model_utils import add_mtp_weights, write_dflash_drafter

DRAFTERS = ["mtp", "dflash", "draft", "draft-on-hybrid", "oracle"]


def build_setups(make_model_dir, tiny_model_dir, tmp_path_factory) -> dict[str, tuple[object, dict]]:
    """drafter -> (target directory, engine options); each test module makes it a module fixture."""
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
