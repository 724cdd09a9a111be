"""The embedded SmolLM2 GGUF through our loader and model equals transformers loading the same file:
fp32 logits at every prompt position, and 32 greedy tokens through the paged KV cache and the engine."""
from __future__ import annotations

import pytest
import torch

from pipeline.models.config import ModelArchConfig
from pipeline.models.loader import iter_weights, load_hf_config
from pipeline.models.registry import build_model
from pipeline.request import SamplingParams
from pipeline.tokenizer import Tokenizer
from tests.conftest import run_async
from tests.engine_utils import collect, config_for
from tests.model_utils import hf_greedy, run_paged

PROMPT = "<|im_start|>user\nWrite a Python function that adds two numbers.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def hf_model(hf_gguf_model):
    return hf_gguf_model


@pytest.fixture(scope="module")
def prompt_ids(smollm_gguf_path):
    return Tokenizer.from_pretrained(smollm_gguf_path).encode(PROMPT, add_special_tokens=False)


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids):
    return hf_greedy(hf_model, prompt_ids, max_new_tokens=32)


def test_logits_and_greedy_tokens_match_transformers(smollm_gguf_path, prompt_ids, reference):
    arch = ModelArchConfig.from_hf(load_hf_config(smollm_gguf_path))
    model = build_model(arch, iter_weights(smollm_gguf_path), dtype=torch.float32, device="cpu")
    ref_logits, ref_tokens, _ = reference
    run = run_paged(model, [prompt_ids], max_new_tokens=32, block_size=16, chunks=[7, 11])
    torch.testing.assert_close(run.prompt_logits[0], ref_logits, atol=2e-3, rtol=1e-3)
    assert run.generated[0] == ref_tokens


def test_engine_greedy_equals_transformers(smollm_gguf_path, prompt_ids, reference):
    async def main():
        from pipeline.engine import Engine

        engine = await Engine.create(config_for(smollm_gguf_path, block_size=16, num_kv_blocks=64))
        try:
            params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
            return (await collect(engine, prompt_token_ids=prompt_ids, params=params))[0].token_ids
        finally:
            await engine.shutdown()

    assert run_async(main()) == reference[1]


def test_engine_bfloat16_tracks_float32(smollm_gguf_path, prompt_ids):
    """The CPU default on bf16-capable machines: same answer as fp32 for the first tokens."""
    async def main():
        from pipeline.engine import Engine

        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outputs = []
        for dtype in ("float32", "bfloat16"):
            engine = await Engine.create(config_for(smollm_gguf_path, dtype=dtype, block_size=16, num_kv_blocks=64))
            try:
                outputs.append((await collect(engine, prompt_token_ids=prompt_ids, params=params))[0].token_ids)
            finally:
                await engine.shutdown()
        return outputs

    fp32, bf16 = run_async(main())
    assert bf16[:4] == fp32[:4]
