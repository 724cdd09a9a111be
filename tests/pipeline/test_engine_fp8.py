"""FP8 checkpoints through the whole engine: a block-FP8 checkpoint serves exactly what the plain checkpoint of its
dequantized weights serves (the CPU dequantizes at load), for batches, a prefix-cache hit and n-gram speculation, on
a dense and a hybrid MoE model; greedy tokens equal transformers' on those weights; --quantization fp8 equals the
plain checkpoint of the quantize-dequantize weights; the banner says what the weights are."""
from __future__ import annotations

import asyncio
import random

import pytest

from pipeline.engine import Engine
from pipeline.request import SamplingParams
from pipeline.spec.replay import ReplayDrafter
from tests.conftest import run_async
from tests.engine_utils import assert_no_leaks, collect, config_for, settle
from tests.fp8_checkpoints import dequantized_checkpoint, online_fp8_weights, to_block_fp8
from tests.model_utils import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def repeating(seed: int) -> list[int]:
    """A prompt that repeats itself, so the n-gram drafter has matches, long enough for full cached blocks."""
    rng = random.Random(seed)
    motif = [rng.randrange(100, 40000) for _ in range(7)]
    return motif * 3 + [rng.randrange(100, 40000) for _ in range(3)] + motif[:4]


BATCH = [repeating(seed) for seed in (1, 2, 3)]


async def workload(model_dir, drafter=None, **overrides) -> tuple[list[list[int]], dict]:
    """Three prompts at once, then one that shares the first's prefix (a prefix-cache hit). ``drafter`` replaces the
    configured one (a random model's output seldom repeats its prompt, so n-gram lookup alone rarely drafts)."""
    engine = await Engine.create(config_for(model_dir, max_num_batched_tokens=24, state_snapshot_interval=8,
                                            **overrides))
    if drafter is not None:
        engine.decode.drafter = drafter
    try:
        batch = BATCH
        results = await asyncio.gather(*[collect(engine, prompt_token_ids=p, params=greedy(24)) for p in batch])
        outputs = [r[0].token_ids for r in results]
        outputs.append((await collect(engine, prompt_token_ids=batch[0] + [5, 6, 7], params=greedy()))[0].token_ids)
        await settle(engine)
        assert_no_leaks(engine)
        return outputs, engine.stats()
    finally:
        await engine.shutdown()


@pytest.fixture(scope="module", params=[("qwen3", dict(hidden_size=200, intermediate_size=160)),
                                        ("qwen3_5_moe_text", dict(hidden_size=200))], ids=["qwen3", "qwen3_5_moe"])
def fp8_pair(request, make_model_dir, tmp_path_factory):
    """(block-FP8 checkpoint, the plain checkpoint of its dequantized weights)."""
    model_type, shape = request.param
    directory = make_model_dir(model_type, seed=11, **shape)
    dequantized = to_block_fp8(directory)
    return directory, dequantized_checkpoint(directory, dequantized, tmp_path_factory.mktemp("dequantized"))


def test_fp8_checkpoint_serves_its_dequantized_weights(fp8_pair):
    """Plain decoding, n-gram speculation, and speculation whose drafts replay the plain output with 30% of them
    wrong (rejections at every position of a row): each the same tokens as the dequantized checkpoint's plain run."""
    fp8_dir, plain_dir = fp8_pair
    plain, _ = run_async(workload(plain_dir))
    fp8, stats = run_async(workload(fp8_dir))
    assert fp8 == plain and stats["prefix_cache"]["hit_tokens"] > 0
    assert run_async(workload(fp8_dir, **SPEC))[0] == plain
    expected = {tuple(p): out for p, out in zip(BATCH, plain)}
    replayed, stats = run_async(workload(fp8_dir, ReplayDrafter(expected, 0.3), **SPEC))
    assert replayed == plain and stats["speculation"]["accepted_tokens"] > 0


def test_fp8_engine_equals_transformers(fp8_pair):
    from transformers import AutoModelForCausalLM

    fp8_dir, plain_dir = fp8_pair
    reference = AutoModelForCausalLM.from_pretrained(plain_dir, attn_implementation="eager").float().eval()
    ids = repeating(4)
    _, tokens, _ = hf_greedy(reference, ids, 12)

    async def serve() -> list[int]:
        engine = await Engine.create(config_for(fp8_dir))
        try:
            return (await collect(engine, prompt_token_ids=ids, params=greedy()))[0].token_ids
        finally:
            await engine.shutdown()

    assert run_async(serve()) == tokens


def test_online_fp8_equals_the_quantize_dequantize_checkpoint(make_model_dir, tmp_path):
    directory = make_model_dir("qwen3_moe", seed=12, hidden_size=200)
    rounded = dequantized_checkpoint(directory, online_fp8_weights(directory), tmp_path / "rounded")
    online, _ = run_async(workload(directory, quantization="fp8"))
    plain, _ = run_async(workload(directory))
    assert online == run_async(workload(rounded))[0]
    assert online != plain  # the rounding is real


def test_banner_names_the_formats(fp8_pair):
    from web.serve import banner

    async def lines() -> str:
        engine = await Engine.create(config_for(fp8_pair[0], kv_cache_dtype="fp8"))
        try:
            return banner(engine, "http://127.0.0.1:1")
        finally:
            await engine.shutdown()

    text = run_async(lines())
    assert "weights fp8 e4m3, 128x128 blocks (fp8), dequantized" in text
    assert "tokens, float8_e4m3fn" in text
