"""Model loading options: --load-format dummy builds random weights from config.json alone."""
import math

import pytest

from pipeline.config import EngineConfig
from pipeline.engine import Engine
from pipeline.request import SamplingParams
from tests.conftest import run_async
from tests.engine_utils import collect, config_for


def test_dummy_weights_need_no_weight_files(tiny_model_dir, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())  # no safetensors at all

    async def main():
        engine = await Engine.create(config_for(tmp_path, load_format="dummy"))
        try:
            out = await collect(engine, prompt_token_ids=[5, 6, 7],
                                params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1))
            return out[0]
        finally:
            await engine.shutdown()

    sample = run_async(main())
    assert len(sample.token_ids) == 6 and all(math.isfinite(lp.logprob) for lp in sample.logprobs)


@pytest.mark.parametrize("field,value", [("load_format", "pickle"), ("gpu_memory_utilization", 1.5)])
def test_bad_loading_options_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value}).validate()


def test_state_snapshots_take_at_most_half_of_the_cpu_kv_memory(make_model_dir):
    """A hybrid model on CPU: a snapshot budget past the KV memory leaves the blocks half of it, not none."""
    from pipeline.loading import load_model

    loaded = load_model(config_for(make_model_dir("qwen3_5_moe_text", seed=5), num_kv_blocks=0,
                                   kv_cache_memory_gib=0.01, state_snapshot_gib=64.0))
    runner = loaded.runner
    memory = int(0.01 * (1 << 30)) - runner.state_bytes
    snapshot_bytes = runner.snapshots[0].shape[0] * runner.bytes_per_snapshot
    assert 0 < snapshot_bytes <= memory // 2
    assert loaded.num_blocks * runner.bytes_per_block >= memory // 2 - runner.bytes_per_block
